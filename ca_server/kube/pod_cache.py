"""Every pod's identity facts, from a watch, indexed by (namespace, name) and by node.

The node authorizer asks two questions per impersonation request — "is the caller's pod what
its token says?" and "does a pod of this service account run on that node?" — and must not
turn each into a GET against the API server. A cluster-wide list+watch of pods keeps just the
fields those questions need (`meshca.pods.PodInfo`, with the one "live pod" rule).

Concurrency: see `Informer` — the watch runs in its own thread; lookups from the event loop
take a lock held only for dictionary operations.
"""

from __future__ import annotations

import kubernetes.client

from ca_server.metrics import CaMetrics
from meshca.informer import Informer
from meshca.pods import BY_NODE, PodInfo, node_of, pod_info


class PodCache:
    def __init__(self, api: kubernetes.client.ApiClient, metrics: CaMetrics) -> None:
        core = kubernetes.client.CoreV1Api(api)
        self._informer: Informer[PodInfo] = Informer(
            "pods",
            core.list_pod_for_all_namespaces,
            pod_info,
            indexers={BY_NODE: node_of},
            on_restart=lambda cause: metrics.kube_watch_restarts.labels("pods", cause).inc(),
        )

    @property
    def synced(self) -> bool:
        return self._informer.synced

    def wait_synced(self, timeout: float) -> bool:
        return self._informer.wait_synced(timeout)

    def start(self) -> None:
        self._informer.start()

    def stop(self) -> None:
        self._informer.stop()

    def get(self, namespace: str, name: str) -> PodInfo | None:
        return self._informer.get((namespace, name))

    def on_node(self, node_name: str) -> list[PodInfo]:
        return self._informer.by_index(BY_NODE, node_name)
