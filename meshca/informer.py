"""List+watch of one Kubernetes resource into an in-memory cache, in a dedicated thread.

The pattern client-go calls an informer, reduced to what meshca needs: list (remember the
list's resourceVersion), then watch from it, applying each event to the cache; when the watch
ends (server timeout) resume from the last seen resourceVersion; on 410 Gone (history
compacted) or any error, list again — after a backoff for errors — and replace the cache. The
thread ends only on `stop()`: an unexpected exception is logged and handled like any error.
Objects are passed through `transform` so a cache can keep only the fields it uses; `indexers`
maintain secondary indexes (e.g. pods by node) next to the primary (namespace, name) key.
Used by the CA (pods, namespaces, ConfigMaps, its root Secret) and by the node agent (the pods
on its node), so it imports only `kubernetes`.

Stopping: `stop()` sets a flag and shuts down a watch's socket (`Watch.stop()`), which ends a
blocked read at once. A *list* in flight cannot be cut off that way (the client gives no handle
on its connection), so the informer abandons it instead: whatever the list returns after
`stop()` is discarded, no callback runs, nothing is retried, and the thread ends as soon as the
call returns (bounded by `request_timeout`). `join` does not wait for an abandoned list, so a
daemon shuts down promptly even against a slow API server.

Concurrency: the watch runs in its own daemon thread and blocks only there. Readers on other
threads (the event loop, the reconciler) take the cache lock for a dictionary lookup; the
watcher holds it only to apply one event or swap in a re-listed cache. `on_change` is called
from the watcher thread after every change and must be quick (it sets an Event).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import urllib3.exceptions
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from meshca.kube_client import KubeCredentialsError, api_error_text

log = logging.getLogger(__name__)

V = TypeVar("V")
Key = tuple[str, str]  # (namespace or "", name)

_HTTP_GONE = 410
_WATCH_SECONDS = 30  # server-side watch timeout; the watch is then resumed
_READ_MARGIN = 15  # client-side read timeout beyond the watch's: a silently dead connection
_BACKOFF_MIN, _BACKOFF_MAX = 0.5, 10.0


def doubling_backoff(failures: int) -> float:
    """Seconds to wait after `failures` consecutive failures: 0.5, 1, 2, ... up to 10."""
    return float(min(_BACKOFF_MIN * 2**failures, _BACKOFF_MAX))


def object_key(obj: Any) -> Key:
    return (obj.metadata.namespace or "", obj.metadata.name)


class Informer(Generic[V]):
    """Keeps `{(namespace, name): transform(object)}` in sync with the API server.

    `list_func` is a generated list method (e.g. `CoreV1Api.list_namespace`, or a
    `functools.partial` binding a namespace); `list_kwargs` are passed to every list and watch
    (field/label selectors). Instead of `list_func`, `connect` may build it on the watcher
    thread (credentials that may not be mounted yet): a failure is retried like a failed list.
    `backoff(failures)` is the wait before retrying after that many consecutive failures.
    """

    def __init__(
        self,
        resource: str,
        list_func: Callable[..., Any] | None,
        transform: Callable[[Any], V],
        *,
        connect: Callable[[], Callable[..., Any]] | None = None,
        list_kwargs: Mapping[str, Any] | None = None,
        indexers: Mapping[str, Callable[[V], str | None]] | None = None,
        on_change: Callable[[], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
        watch_seconds: int = _WATCH_SECONDS,
        request_timeout: float | None = None,
        bookmarks: bool = True,
        backoff: Callable[[int], float] = doubling_backoff,
    ) -> None:
        if (list_func is None) == (connect is None):
            raise ValueError("give exactly one of list_func and connect")
        self.resource = resource
        self._list_func = list_func
        self._connect = connect
        self._watch_seconds = watch_seconds
        self._request_timeout = request_timeout or watch_seconds + _READ_MARGIN
        self._bookmarks = bookmarks
        self._backoff = backoff
        self._listing = False
        # Why the last list or watch failed, until a list succeeds: what `/ready` shows while a
        # cache cannot sync (RBAC, an unreachable API server).
        self.last_error: str | None = None
        self.lists = 0  # full lists completed (1 + re-lists), for tests and logs
        self._transform = transform
        self._list_kwargs = dict(list_kwargs or {})
        self._indexers = dict(indexers or {})
        self._on_change = on_change or (lambda: None)
        self._on_restart = on_restart or (lambda cause: None)
        self._lock = threading.Lock()
        self._items: dict[Key, V] = {}
        self._indexes: dict[str, dict[str, set[Key]]] = {name: {} for name in self._indexers}
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name=f"informer-{resource}", daemon=True)

    # -- readers (any thread) --------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The watcher thread is running (started and not ended)."""
        return self._thread.is_alive()

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def get(self, key: Key) -> V | None:
        with self._lock:
            return self._items.get(key)

    def items(self) -> dict[Key, V]:
        with self._lock:
            return dict(self._items)

    def by_index(self, index: str, value: str) -> list[V]:
        with self._lock:
            keys = self._indexes[index].get(value, set())
            return [self._items[key] for key in keys]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Asks the thread to end: a watch ends now, a list in flight is abandoned (see the
        module docstring)."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()

    def join(self, timeout: float) -> bool:
        """After `stop()`: waits up to `timeout` for the thread, but not for an abandoned list.
        True when nothing more will come from the thread."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and not self._listing and time.monotonic() < deadline:
            self._thread.join(0.05)  # short steps: the thread may enter a list meanwhile
        return not self._thread.is_alive() or self._listing

    # -- the watcher thread ----------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            backoff = self._backoff(failures)
            try:
                if self._list_func is None:
                    assert self._connect is not None
                    self._list_func = self._connect()
                resource_version = self._relist()
                if resource_version is None:  # stopped while listing
                    return
                failures = 0
                self.last_error = None
                backoff = self._backoff(failures)
                while not self._stopping.is_set():
                    resource_version = self._watch_from(resource_version)
            except ApiException as exc:
                if self._stopping.is_set():
                    return
                if exc.status == _HTTP_GONE:
                    log.info("%s watch expired (410 Gone); listing again", self.resource)
                    self._on_restart("expired")
                    continue
                self.last_error = api_error_text(exc)
                log.warning(
                    "%s list/watch failed: %s; retrying in %.1fs",
                    self.resource,
                    self.last_error,
                    backoff,
                )
                self._on_restart("error")
            except (urllib3.exceptions.HTTPError, OSError, ValueError, KubeCredentialsError) as exc:
                if self._stopping.is_set():
                    return
                self.last_error = str(exc) or type(exc).__name__
                log.warning(
                    "%s list/watch failed: %s; retrying in %.1fs", self.resource, exc, backoff
                )
                self._on_restart("error")
            except Exception:
                # Anything else (an object `transform` cannot read, a client bug) must not end
                # the thread: the cache would stay "synced" while silently going stale.
                if self._stopping.is_set():
                    return
                self.last_error = "an unexpected error (see the CA's log)"
                log.exception(
                    "%s list/watch failed unexpectedly; retrying in %.1fs", self.resource, backoff
                )
                self._on_restart("error")
            self._stopping.wait(backoff)
            failures += 1

    def _relist(self) -> str | None:
        """Lists and replaces the cache; None when `stop()` came while the list was in flight."""
        assert self._list_func is not None
        self._listing = True
        try:
            result = self._list_func(**self._list_kwargs, _request_timeout=self._request_timeout)
        finally:
            self._listing = False
        if self._stopping.is_set():
            return None
        self.lists += 1
        items = {object_key(obj): self._transform(obj) for obj in result.items}
        indexes: dict[str, dict[str, set[Key]]] = {name: {} for name in self._indexers}
        for key, value in items.items():
            self._index_add(indexes, key, value)
        with self._lock:
            self._items, self._indexes = items, indexes
        self._synced.set()
        self._on_change()
        return str(result.metadata.resource_version)

    def _watch_from(self, resource_version: str) -> str:
        """Applies events until the server ends the watch; returns where to resume."""
        assert self._list_func is not None
        self._watch = watch.Watch()
        stream = self._watch.stream(
            self._list_func,
            **self._list_kwargs,
            resource_version=resource_version,
            allow_watch_bookmarks=self._bookmarks,
            timeout_seconds=self._watch_seconds,
            _request_timeout=self._request_timeout,
        )
        for event in stream:
            if self._stopping.is_set():
                break
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                self._apply(event["type"], event["object"])
        return str(self._watch.resource_version or resource_version)

    def _apply(self, kind: str, obj: Any) -> None:
        key = object_key(obj)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._index_remove(key, old)
            if kind != "DELETED":
                value = self._transform(obj)
                self._items[key] = value
                self._index_add(self._indexes, key, value)
        self._on_change()

    def _index_add(self, indexes: dict[str, dict[str, set[Key]]], key: Key, value: V) -> None:
        for name, indexer in self._indexers.items():
            index_value = indexer(value)
            if index_value is not None:
                indexes[name].setdefault(index_value, set()).add(key)

    def _index_remove(self, key: Key, value: V) -> None:
        for name, indexer in self._indexers.items():
            index_value = indexer(value)
            if index_value is None:
                continue
            keys = self._indexes[name].get(index_value)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._indexes[name][index_value]
