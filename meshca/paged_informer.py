"""A cluster-wide list+watch kept compact: paginated raw-JSON lists, a raw-JSON watch, counted
indexes, and a re-list that updates the cache in place.

Why not `Informer` as it is: at Kubernetes' envelope (150,000 pods) the generated client's way
costs what the CA cannot pay. One unpaginated list is one response of hundreds of megabytes,
deserialized through model classes (~500 µs and ~33 KB of transient memory per pod), and a
re-list builds a second cache beside the first. Here:

- **The state is streamed** (watch-list: a watch with `sendInitialEvents`, served from the API
  server's watch cache — no list response is built on either side, and etcd is not read), each
  object parsed with `json.loads` straight into the compact value `transform` makes of a plain
  dict. An API server that does not offer it (400/422) is listed **in pages** instead (`limit`
  + `continue`, `page_size` objects per request, each page dropped before the next is asked
  for). Either way the transient memory is one object's or one page's, whatever the cluster's
  size, and `listed` counts the objects received so far (the progress `/ready` shows while the
  first list runs).
- **The watch is read raw**: one `json.loads` per event line, no model objects.
- **A re-list (410 Gone, an error) updates the cache in place**: every listed object is upserted
  (an unchanged value keeps its old object), then what the list did not contain is removed. There
  is never a second copy of the cache; readers meanwhile see each object either as it was or as
  it is now, as they would while a watch catches up.
- **Counted indexes** (`counters`) answer "how many cached values have this key" with one int per
  key instead of a set of object keys (a set costs ~200 bytes even for one member).

Everything else (the thread, stopping, backoff, restarts, `on_change`) is `Informer`'s.
Concurrency: as `Informer`; the lock is taken once per page of a list and once per event.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from meshca.informer import Informer, Key

log = logging.getLogger(__name__)

V = TypeVar("V")
RawObject = dict[str, Any]

DEFAULT_PAGE_SIZE = 500  # client-go's pager default
# How long the API server may take to stream a whole state (it ends the watch then; an
# unfinished state is streamed again). Events arrive continuously meanwhile, so the client's
# read timeout still catches a dead connection.
_STREAM_SECONDS = 600
_PROGRESS_EVERY = 500
# Answers of an API server that does not offer watch-list (too old, or the feature is off).
_NO_WATCH_LIST = frozenset({400, 422})
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


def _initial_events_end(event: Any) -> str | None:
    """The resource version of the bookmark that ends a watch-list's initial state, else None."""
    if not isinstance(event, dict) or event.get("type") != "BOOKMARK":
        return None
    metadata = (event.get("object") or {}).get("metadata") or {}
    if (metadata.get("annotations") or {}).get(INITIAL_EVENTS_END) != "true":
        return None
    return str(metadata.get("resourceVersion") or "")


def raw_key(obj: RawObject) -> Key:
    """`(namespace or "", name)` of a raw object; the namespace string is interned (a cluster
    has few namespaces and every cached key of one shares it)."""
    metadata = obj.get("metadata") or {}
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("an object without metadata.name")
    namespace = metadata.get("namespace") or ""
    return (sys.intern(namespace) if isinstance(namespace, str) else "", name)


class PagedInformer(Informer[V]):
    """Keeps `{(namespace, name): transform(raw object)}` in sync, compactly (module docstring).

    `list_func` is a generated list method; it is called with `_preload_content=False`, so it
    returns the raw HTTP response. `pace()` says how long to wait before each page (a token
    bucket's reservation: the CA's client-side rate limit, as client-go's applies to every page).
    `counters` name functions of a value giving a hashable key
    (or None: not counted); `count(counter, key)` says how many cached values give that key.
    """

    def __init__(
        self,
        resource: str,
        list_func: Callable[..., Any],
        transform: Callable[[RawObject], V],
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        pace: Callable[[], float] = lambda: 0.0,
        stream_lists: bool = True,
        counters: Mapping[str, Callable[[V], Hashable | None]] | None = None,
        **informer_kwargs: Any,
    ) -> None:
        super().__init__(resource, list_func, transform, **informer_kwargs)
        self._page_size = page_size
        self._pace = pace
        self._stream_lists = stream_lists
        self._counters = dict(counters or {})
        self._counts: dict[str, dict[Hashable, int]] = {name: {} for name in self._counters}
        self._response: Any = None
        self.listed = 0  # objects received by the list in progress, or by the last one

    # -- readers (any thread) --------------------------------------------------------------

    def count(self, counter: str, key: Hashable) -> int:
        with self._lock:
            return self._counts[counter].get(key, 0)

    def __len__(self) -> int:
        return len(self._items)

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        super().stop()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # already closed: nothing to unblock
                response.shutdown()  # ends a read blocked on the watch's socket at once

    # -- the watcher thread ----------------------------------------------------------------

    def _relist(self) -> str | None:
        """The whole state, streamed from the API server's watch cache (watch-list), or paged
        when the server does not offer that; the cache is updated in place either way."""
        if self._stream_lists:
            try:
                return self._stream_state()
            except ApiException as exc:
                if exc.status not in _NO_WATCH_LIST:
                    raise
                self._stream_lists = False
                log.info(
                    "%s: the API server does not stream lists (watch-list, HTTP %s); "
                    "listing in pages of %d",
                    self.resource,
                    exc.status,
                    self._page_size,
                )
        return self._paged_state()

    def _stream_state(self) -> str | None:
        """Watch-list (`sendInitialEvents`): every object as an ADDED event from the API
        server's watch cache, then a bookmark marked `k8s.io/initial-events-end` carrying the
        resource version to watch on from. One request, no list built on either side."""
        assert self._list_func is not None
        if self._stopping.wait(self._pace()):
            return None
        seen: set[Key] = set()
        self.listed = 0
        response = self._list_func(
            **self._list_kwargs,
            watch=True,
            send_initial_events=True,
            resource_version_match="NotOlderThan",
            allow_watch_bookmarks=True,
            timeout_seconds=_STREAM_SECONDS,
            _preload_content=False,
            _request_timeout=self._request_timeout,
        )
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if self._stopping.is_set():
                    return None
                if not line:
                    continue
                event = json.loads(line)
                end = _initial_events_end(event)
                if end is not None:
                    self._sweep(seen)
                    return end
                kind = event.get("type") if isinstance(event, dict) else None
                obj = event.get("object") if isinstance(event, dict) else None
                if kind in ("ADDED", "MODIFIED") and isinstance(obj, dict):
                    key = raw_key(obj)
                    with self._lock:
                        seen.add(self._upsert(key, self._transform(obj)))
                    self.listed += 1
                    if self.listed % _PROGRESS_EVERY == 0:
                        self._on_change()
                    continue
                if kind == "DELETED" and isinstance(obj, dict):
                    seen.discard(raw_key(obj))
                # Anything else before the initial state ended is applied as a watch would
                # apply it (an ERROR raises: 410 and the like restart the list).
                self._event(event, "")
        finally:
            self._response = None
            response.release_conn()
        if self._stopping.is_set():
            return None
        raise ValueError(f"{self.resource}: the watch-list stream ended before its initial state")

    def _sweep(self, seen: set[Key]) -> None:
        """After a whole state: drops what it did not contain, and says the cache is synced."""
        with self._lock:
            for key in [key for key in self._items if key not in seen]:
                self._drop(key)
        self.lists += 1
        self._synced.set()
        self._on_change()

    def _paged_state(self) -> str | None:
        assert self._list_func is not None
        seen: set[Key] = set()
        token: str | None = None
        self.listed = 0
        while True:
            page = self._page(token)
            if page is None:
                return None
            items = page.get("items") or []
            upserts = [(raw_key(obj), obj) for obj in items]
            with self._lock:
                for key, obj in upserts:
                    seen.add(self._upsert(key, self._transform(obj)))
            self.listed += len(items)
            del items, upserts
            metadata = page.get("metadata") or {}
            token = metadata.get("continue") or None
            if token is None:
                break
            self._on_change()  # progress for readers of `listed`
        self._sweep(seen)
        return str(metadata.get("resourceVersion") or "")

    def _page(self, token: str | None) -> RawObject | None:
        """One page of the list; None when `stop()` came while it was in flight."""
        assert self._list_func is not None
        if self._stopping.wait(self._pace()):
            return None
        self._listing = True
        try:
            response = self._list_func(
                **self._list_kwargs,
                limit=self._page_size,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._request_timeout,
            )
            body = response.data
        finally:
            self._listing = False
        if self._stopping.is_set():
            return None
        page = json.loads(body)
        if not isinstance(page, dict):
            raise ValueError(f"{self.resource} list: the response is not an object")
        return page

    def _watch_from(self, resource_version: str) -> str:
        assert self._list_func is not None
        response = self._list_func(
            **self._list_kwargs,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=self._bookmarks,
            timeout_seconds=self._watch_seconds,
            _preload_content=False,
            _request_timeout=self._request_timeout,
        )
        self._response = response
        try:
            if self._stopping.is_set():
                return resource_version
            for line in iter_resp_lines(response):
                if self._stopping.is_set():
                    break
                if line:
                    resource_version = self._event(json.loads(line), resource_version)
        finally:
            self._response = None
            response.release_conn()
        return resource_version

    def _event(self, event: Any, resource_version: str) -> str:
        """Applies one watch event; returns the resource version to resume from."""
        if not isinstance(event, dict):
            raise ValueError(f"{self.resource} watch: an event that is not an object")
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, dict):
            raise ValueError(f"{self.resource} watch: a {kind} event without an object")
        if kind == "ERROR":  # a Status: 410 Gone when the history was compacted
            raise ApiException(status=int(obj.get("code") or 500), reason=obj.get("message"))
        version = (obj.get("metadata") or {}).get("resourceVersion") or resource_version
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            key = raw_key(obj)
            value = self._transform(obj) if kind != "DELETED" else None
            with self._lock:
                if value is None:
                    self._drop(key)
                else:
                    self._upsert(key, value)
            self._on_change()
        return str(version)

    # -- the cache (lock held) -------------------------------------------------------------

    def _upsert(self, key: Key, value: V) -> Key:
        old = self._items.get(key)
        if old is not None:
            if old == value:
                return key
            self._uncount(old)
        self._items[key] = value
        self._count(value)
        return key

    def _drop(self, key: Key) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._uncount(old)

    def _count(self, value: V) -> None:
        for name, counter in self._counters.items():
            counted = counter(value)
            if counted is not None:
                counts = self._counts[name]
                counts[counted] = counts.get(counted, 0) + 1

    def _uncount(self, value: V) -> None:
        for name, counter in self._counters.items():
            counted = counter(value)
            if counted is None:
                continue
            counts = self._counts[name]
            left = counts.get(counted, 0) - 1
            if left > 0:
                counts[counted] = left
            else:
                counts.pop(counted, None)
