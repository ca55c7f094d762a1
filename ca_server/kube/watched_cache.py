"""The lifecycle every cluster-wide cache of the CA shares: one `PagedInformer` (paginated
raw-JSON list, raw watch, compact values) to start, stop and follow, with the cache's own typed
lookups on top (`PodCache`, `ServiceAccountCache`).

`progress()` is what `/ready` and the cache gauges (`ca_server.kube.caches.KubeCacheCollector`)
show: whether the cache has synced, how many objects it holds or has listed so far, why its last
list failed, and its restarts by cause. The cache counts them itself rather than in `CaMetrics`
because with `--workers N` it lives in the supervisor, which has no `CaMetrics` of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ca_server.errors import CacheSyncingError
from meshca.paged_informer import DEFAULT_PAGE_SIZE, PagedInformer, RawObject

V = TypeVar("V")


@dataclass(frozen=True)
class CacheProgress:
    """A cache's state: synced, the objects it holds (synced) or has listed so far (still
    listing), why its last list or watch failed (until one succeeds), and its restarts."""

    resource: str
    synced: bool
    objects: int
    last_error: str | None = None
    restarts: Mapping[str, int] = field(default_factory=dict)

    def line(self) -> str:
        if self.synced:
            text = f"{self.resource} cache: synced, {self.objects:,} {self.resource}"
        else:
            text = f"{self.resource} cache: syncing, {self.objects:,} {self.resource} listed so far"
        if self.last_error:
            text += f" (last attempt failed: {self.last_error})"
        return text


class WatchedCache(Generic[V]):
    def __init__(
        self,
        resource: str,
        list_func: Callable[..., Any],
        transform: Callable[[RawObject], V],
        counters: Mapping[str, Callable[[V], Hashable | None]] | None = None,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        pace: Callable[[], float] = lambda: 0.0,
        stream_lists: bool = True,
    ) -> None:
        # Bumped on every change the watch applies (and every page of a list), so a reader can
        # reuse what it derived from the cache while nothing changed.
        self.changes = 0
        self.resource = resource
        self._restarts: Counter[str] = Counter()
        self._informer: PagedInformer[V] = PagedInformer(
            resource,
            list_func,
            transform,
            counters=counters,
            page_size=page_size,
            pace=pace,
            stream_lists=stream_lists,
            on_restart=self._restarted,
            on_change=self._changed,
        )

    def _changed(self) -> None:
        self.changes += 1

    def _restarted(self, cause: str) -> None:
        self._restarts[cause] += 1

    @property
    def synced(self) -> bool:
        return self._informer.synced

    def progress(self) -> CacheProgress:
        synced = self._informer.synced
        count = len(self._informer) if synced else self._informer.listed
        return CacheProgress(
            self.resource, synced, count, self._informer.last_error, dict(self._restarts)
        )

    def wait_synced(self, timeout: float) -> bool:
        return self._informer.wait_synced(timeout)

    def start(self) -> None:
        self._informer.start()

    def stop(self) -> None:
        self._informer.stop()

    def join(self, timeout: float) -> bool:
        return self._informer.join(timeout)


_RETRY_WHILE_SYNCING_MS = 2_000


def syncing_error(progress: CacheProgress, reason: str, needs: str) -> CacheSyncingError:
    """The refusal of a request that needs a cache still listing: `UNAVAILABLE`, a retry hint,
    and how far the list has got."""
    return CacheSyncingError(
        reason,
        f"{needs} needs the CA's {progress.resource} cache, which is still listing "
        f"({progress.line()}); retry shortly",
        retry_after_ms=_RETRY_WHILE_SYNCING_MS,
    )
