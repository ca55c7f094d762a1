"""Every pod's identity facts, from a watch, keyed by (namespace, name), with a count of live
scheduled pods per (node, namespace, service account).

The node authorizer asks two questions per impersonation request — "is the caller's pod what
its token says?" and "does a pod of this service account run on that node?" — offline token
validation asks the first, and the fleet's reports ask whether a report's pod still exists.
None may turn into a GET against the API server. A cluster-wide list+watch of pods keeps just
the fields those questions need (`meshca.pods.PodInfo`, with the one "live pod" rule), parsed
from raw JSON page by page (`meshca.paged_informer`): about 0.5 KB per pod, so the 150,000 pods
of Kubernetes' envelope fit in ~75 MB.

`PodLookup` is what the questions need; with `--workers N` the workers ask the supervisor's one
cache through `ca_server.kube.cache_client` instead of holding their own.

Concurrency: see `Informer` — the watch runs in its own thread; lookups from the event loop
take a lock held only for dictionary operations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import kubernetes.client

from ca_server.kube.watched_cache import CacheProgress, WatchedCache
from meshca.paged_informer import DEFAULT_PAGE_SIZE
from meshca.pods import PodInfo, pod_info_from_json

_LIVE_BY_NODE_ACCOUNT = "node-account"

NodeAccount = tuple[str, str, str]  # (node, namespace, service account)


class PodLookup(Protocol):
    """The pod questions the CA asks, answered by a local `PodCache` or the supervisor's."""

    @property
    def synced(self) -> bool: ...

    @property
    def changes(self) -> int: ...

    def progress(self) -> CacheProgress: ...

    def get(self, namespace: str, name: str) -> PodInfo | None: ...

    def get_many(self, keys: list[tuple[str, str]]) -> list[PodInfo | None]: ...

    def runs_on_node(self, node_name: str, namespace: str, service_account: str) -> bool: ...

    async def fetch(self, namespace: str, name: str) -> PodInfo | None:
        """`get` for the event loop: never waits on a socket there."""
        ...

    async def fetch_runs_on_node(self, node_name: str, namespace: str, account: str) -> bool:
        """`runs_on_node` for the event loop."""
        ...


def _live_node_account(pod: PodInfo) -> NodeAccount | None:
    """Counted key of a live pod scheduled on a node (`meshca.pods`); `None` leaves it out."""
    if not pod.live or pod.node_name is None:
        return None
    return (pod.node_name, pod.namespace, pod.service_account)


class PodCache(WatchedCache[PodInfo]):
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        pace: Callable[[], float] = lambda: 0.0,
        stream_lists: bool = True,
    ) -> None:
        core = kubernetes.client.CoreV1Api(api)
        super().__init__(
            "pods",
            core.list_pod_for_all_namespaces,
            pod_info_from_json,
            counters={_LIVE_BY_NODE_ACCOUNT: _live_node_account},
            page_size=page_size,
            pace=pace,
            stream_lists=stream_lists,
        )

    def get(self, namespace: str, name: str) -> PodInfo | None:
        return self._informer.get((namespace, name))

    def get_many(self, keys: list[tuple[str, str]]) -> list[PodInfo | None]:
        return [self._informer.get(key) for key in keys]

    async def fetch(self, namespace: str, name: str) -> PodInfo | None:
        return self.get(namespace, name)

    async def fetch_runs_on_node(self, node_name: str, namespace: str, account: str) -> bool:
        return self.runs_on_node(node_name, namespace, account)

    def runs_on_node(self, node_name: str, namespace: str, service_account: str) -> bool:
        """Whether a live pod of `namespace/service_account` is scheduled on `node_name`: one
        counter lookup, whatever the pods on the node."""
        key = (node_name, namespace, service_account)
        return self._informer.count(_LIVE_BY_NODE_ACCOUNT, key) > 0
