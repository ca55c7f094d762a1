"""Every pod's identity facts, from a watch, indexed by (namespace, name) and, for live
scheduled pods, by (node, namespace, service account).

The node authorizer asks two questions per impersonation request — "is the caller's pod what
its token says?" and "does a pod of this service account run on that node?" — and must not
turn each into a GET against the API server. A cluster-wide list+watch of pods keeps just the
fields those questions need (`meshca.pods.PodInfo`, with the one "live pod" rule).

Concurrency: see `Informer` — the watch runs in its own thread; lookups from the event loop
take a lock held only for dictionary operations.
"""

from __future__ import annotations

import kubernetes.client

from ca_server.kube.watched_cache import WatchedCache
from ca_server.metrics import CaMetrics
from meshca.pods import PodInfo, pod_info

_LIVE_BY_NODE_ACCOUNT = "node-account"


def _node_account_key(node_name: str, namespace: str, service_account: str) -> str:
    # NUL cannot occur in Kubernetes names, so the key is unambiguous.
    return f"{node_name}\0{namespace}\0{service_account}"


def _live_node_account(pod: PodInfo) -> str | None:
    """Index key of a live pod scheduled on a node (`meshca.pods`); `None` leaves it out."""
    if not pod.live or pod.node_name is None:
        return None
    return _node_account_key(pod.node_name, pod.namespace, pod.service_account)


class PodCache(WatchedCache[PodInfo]):
    def __init__(self, api: kubernetes.client.ApiClient, metrics: CaMetrics) -> None:
        core = kubernetes.client.CoreV1Api(api)
        super().__init__(
            "pods",
            core.list_pod_for_all_namespaces,
            pod_info,
            metrics,
            indexers={_LIVE_BY_NODE_ACCOUNT: _live_node_account},
        )

    def get(self, namespace: str, name: str) -> PodInfo | None:
        return self._informer.get((namespace, name))

    def runs_on_node(self, node_name: str, namespace: str, service_account: str) -> bool:
        """Whether a live pod of `namespace/service_account` is scheduled on `node_name`.

        One index lookup: the cost does not grow with the pods on the node (the index holds
        only the matching live pods, typically one or a few replicas).
        """
        key = _node_account_key(node_name, namespace, service_account)
        return bool(self._informer.by_index(_LIVE_BY_NODE_ACCOUNT, key))
