"""The lifecycle every watch-backed cache of the CA shares: one `Informer` over a cluster-wide
list (its restarts counted in `meshca_ca_kube_watch_restarts{resource,cause}`) to start, stop
and wait for, with the cache's own typed lookups on top (`PodCache`, `ServiceAccountCache`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from ca_server.metrics import CaMetrics
from meshca.informer import Informer

V = TypeVar("V")


class WatchedCache(Generic[V]):
    def __init__(
        self,
        resource: str,
        list_func: Callable[..., Any],
        transform: Callable[[Any], V],
        metrics: CaMetrics,
        indexers: Mapping[str, Callable[[V], str | None]] | None = None,
    ) -> None:
        restarts = metrics.kube_watch_restarts
        # Bumped on every change the watch applies (and every re-list), so a reader can reuse
        # what it derived from the cache while nothing changed.
        self.changes = 0
        self._informer: Informer[V] = Informer(
            resource,
            list_func,
            transform,
            indexers=indexers,
            on_restart=lambda cause: restarts.labels(resource, cause).inc(),
            on_change=self._changed,
        )

    def _changed(self) -> None:
        self.changes += 1

    @property
    def synced(self) -> bool:
        return self._informer.synced

    def wait_synced(self, timeout: float) -> bool:
        return self._informer.wait_synced(timeout)

    def start(self) -> None:
        self._informer.start()

    def stop(self) -> None:
        self._informer.stop()
