"""The object store: one global resourceVersion, a bounded event history, and watchers.

Everything happens under a single lock, so concurrent clients observe a linearizable history:
two racing creates of the same name yield exactly one success and one ``AlreadyExists``, and a
watcher registered at resourceVersion N sees every later event exactly once, in order.
"""

from __future__ import annotations

import copy
import queue
import re
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from . import errors
from .patch import apply_patch
from .resources import CLUSTERTRUSTBUNDLES, NAMESPACES, RESOURCE_TYPES, ResourceType, apply_defaults
from .selectors import Predicate, match_all

ADDED = "ADDED"
MODIFIED = "MODIFIED"
DELETED = "DELETED"
BOOKMARK = "BOOKMARK"

# Namespaces a fresh cluster has; creating objects elsewhere needs the namespace first.
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def _checked_name(rt: ResourceType, obj: dict[str, Any], name: str) -> str:
    """The part of `name` that must be a DNS subdomain: a ClusterTrustBundle of a signer is
    named `<signer, / → :>:<subdomain>` (the handler checks the prefix)."""
    signer = (obj.get("spec") or {}).get("signerName") if rt is CLUSTERTRUSTBUNDLES else None
    return name.removeprefix(signer.replace("/", ":") + ":") if signer else name


_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"

Key = tuple[str, str]  # (namespace, name); namespace is "" for cluster-scoped objects.


def now_timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
        obj["metadata"] = meta
    return meta


@dataclass(frozen=True)
class Event:
    """A committed change. ``old`` is the previous state for MODIFIED (for selector moves)."""

    rv: int
    type: str
    rt: ResourceType
    obj: dict[str, Any]
    old: dict[str, Any] | None = None


class Watcher:
    """A live subscription; the store pushes ``(type, object)`` pairs onto ``queue``.

    ``None`` on the queue means the store is shutting down and the stream should end.
    """

    def __init__(self, rt: ResourceType, namespace: str | None, predicate: Predicate) -> None:
        self.rt = rt
        self.namespace = namespace
        self.predicate = predicate
        self.queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()

    def translate(self, event: Event) -> tuple[str, dict[str, Any]] | None:
        """Map a store event to what this watcher sees, honouring selector transitions.

        Like the real server, an object that stops matching a selector is reported as DELETED
        and one that starts matching as ADDED.
        """
        if event.rt is not self.rt:
            return None
        if self.namespace and _meta(event.obj).get("namespace") != self.namespace:
            return None
        new_match = self.predicate(event.obj)
        if event.type != MODIFIED:
            return (event.type, event.obj) if new_match else None
        old_match = event.old is not None and self.predicate(event.old)
        if new_match and old_match:
            return (MODIFIED, event.obj)
        if new_match:
            return (ADDED, event.obj)
        if old_match:
            return (DELETED, event.obj)
        return None

    def offer(self, event: Event) -> None:
        if (seen := self.translate(event)) is not None:
            self.queue.put(seen)


class Store:
    """In-memory objects for every ``ResourceType``, plus change history for watch resume."""

    def __init__(self, *, history_limit: int = 1000, require_namespaces: bool = True) -> None:
        self._lock = threading.RLock()
        self._objects: dict[ResourceType, dict[Key, dict[str, Any]]] = {
            rt: {} for rt in RESOURCE_TYPES
        }
        self._rv = 0
        self._history: deque[Event] = deque()
        self.history_limit = history_limit
        # Highest resourceVersion whose event was dropped from history; watches from
        # below it cannot be served and get 410 Gone.
        self._compacted_rv = 0
        self._watchers: set[Watcher] = set()
        self.require_namespaces = require_namespaces

    # -- bookkeeping -------------------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store lock (lets tests make several changes atomically)."""
        with self._lock:
            yield

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    @property
    def oldest_resource_version(self) -> int:
        """Watches from any resourceVersion >= this can still be resumed."""
        with self._lock:
            return self._compacted_rv

    def compact(self) -> None:
        """Forget all history, as etcd compaction does; older watch resumes then get 410."""
        with self._lock:
            self._history.clear()
            self._compacted_rv = self._rv

    def _commit(
        self, type_: str, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        event = Event(int(_meta(obj)["resourceVersion"]), type_, rt, obj, old)
        self._history.append(event)
        while len(self._history) > self.history_limit:
            self._compacted_rv = self._history.popleft().rv
        for watcher in self._watchers:
            watcher.offer(event)

    def _bump(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        _meta(obj)["resourceVersion"] = str(self._rv)

    def _bucket(self, rt: ResourceType) -> dict[Key, dict[str, Any]]:
        return self._objects[rt]

    def _key(self, rt: ResourceType, namespace: str | None, name: str) -> Key:
        return ((namespace or "") if rt.namespaced else "", name)

    def _current(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._bucket(rt).get(self._key(rt, namespace, name))
        if obj is None:
            raise errors.not_found(rt.plural, name, rt.group)
        return obj

    # -- verbs -------------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._current(rt, namespace, name))

    def list(
        self, rt: ResourceType, namespace: str | None = None, predicate: Predicate = match_all
    ) -> tuple[list[dict[str, Any]], int]:
        """Matching objects sorted by (namespace, name), and the store resourceVersion."""
        with self._lock:
            items = [
                copy.deepcopy(obj)
                for key, obj in sorted(self._bucket(rt).items())
                if (not namespace or key[0] == namespace) and predicate(obj)
            ]
            return items, self._rv

    def create(
        self,
        rt: ResourceType,
        namespace: str | None,
        obj: dict[str, Any],
        *,
        trusted: bool = False,
    ) -> dict[str, Any]:
        """Create ``obj``; ``trusted`` (test seeding) keeps a caller-supplied uid/status."""
        obj = copy.deepcopy(obj)
        meta = _meta(obj)
        with self._lock:
            if rt.namespaced:
                body_ns = meta.get("namespace")
                namespace = namespace or body_ns
                if not namespace:
                    raise errors.bad_request("a namespace is required for namespaced resources")
                if body_ns and body_ns != namespace:
                    raise errors.bad_request(
                        "the namespace of the provided object does not match the namespace "
                        "sent on the request"
                    )
                meta["namespace"] = namespace
                if self.require_namespaces and ("", namespace) not in self._bucket(NAMESPACES):
                    raise errors.not_found("namespaces", namespace)
            else:
                meta.pop("namespace", None)
            name = meta.get("name")
            if not name:
                prefix = meta.get("generateName")
                if not prefix:
                    raise errors.invalid(
                        rt.kind,
                        "",
                        "metadata.name: Required value: name or generateName is required",
                    )
                while True:
                    suffix = "".join(secrets.choice(_GENERATE_ALPHABET) for _ in range(5))
                    name = f"{prefix}{suffix}"
                    if self._key(rt, namespace, name) not in self._bucket(rt):
                        break
                meta["name"] = name
            if not _NAME_RE.match(_checked_name(rt, obj, name)) or len(name) > 253:
                raise errors.invalid(
                    rt.kind,
                    name,
                    f"metadata.name: Invalid value: {name!r}: a lowercase RFC "
                    "1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'",
                )
            key = self._key(rt, namespace, name)
            if key in self._bucket(rt):
                raise errors.already_exists(rt.plural, name, rt.group)
            obj["apiVersion"] = rt.api_version
            obj["kind"] = rt.kind
            if not trusted or not meta.get("uid"):
                meta["uid"] = str(uuid.uuid4())
            if not trusted or not meta.get("creationTimestamp"):
                meta["creationTimestamp"] = now_timestamp()
            for transient in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
                meta.pop(transient, None)
            apply_defaults(rt, obj)
            self._bump(obj)
            self._bucket(rt)[key] = obj
            self._commit(ADDED, rt, obj, None)
            return copy.deepcopy(obj)

    def update(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        obj: dict[str, Any],
        *,
        subresource: str | None = None,
        keep_status: bool = False,
    ) -> dict[str, Any]:
        """Replace an object (PUT).

        A non-empty ``metadata.resourceVersion`` is an optimistic-concurrency precondition.
        ``subresource="status"`` changes only ``status``; ``keep_status`` makes a main-resource
        update ignore ``status`` (as the server does for pods and namespaces).
        """
        obj = copy.deepcopy(obj)
        meta = _meta(obj)
        with self._lock:
            current = self._current(rt, namespace, name)
            cur_meta = current["metadata"]
            body_name = meta.get("name") or name
            if body_name != name:
                raise errors.bad_request(
                    f"the name of the object ({body_name}) does not match the name on the URL "
                    f"({name})"
                )
            body_ns = meta.get("namespace")
            if rt.namespaced and body_ns and body_ns != cur_meta.get("namespace"):
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            wanted_rv = meta.get("resourceVersion")
            if wanted_rv and wanted_rv != cur_meta["resourceVersion"]:
                raise errors.conflict(rt.plural, name, rt.group)
            if subresource == "status":
                new = copy.deepcopy(current)
                if "status" in obj:
                    new["status"] = obj["status"]
                else:
                    new.pop("status", None)
            else:
                new = obj
                if keep_status:
                    if "status" in current:
                        new["status"] = copy.deepcopy(current["status"])
                    else:
                        new.pop("status", None)
                new_meta = _meta(new)
                new_meta["name"] = name
                if rt.namespaced:
                    new_meta["namespace"] = cur_meta["namespace"]
                else:
                    new_meta.pop("namespace", None)
                for immutable in ("uid", "creationTimestamp"):
                    new_meta[immutable] = cur_meta[immutable]
                new["apiVersion"] = rt.api_version
                new["kind"] = rt.kind
                apply_defaults(rt, new)
            _meta(new)["resourceVersion"] = cur_meta["resourceVersion"]
            if new == current:
                # The real server does not bump resourceVersion or emit events for no-ops.
                return copy.deepcopy(current)
            self._bump(new)
            self._bucket(rt)[self._key(rt, namespace, name)] = new
            self._commit(MODIFIED, rt, new, current)
            return copy.deepcopy(new)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        body: Any,
        *,
        subresource: str | None = None,
        keep_status: bool = False,
    ) -> dict[str, Any]:
        """Apply a PATCH atomically against the current object (a patched rv is a precondition)."""
        with self._lock:
            current = self._current(rt, namespace, name)
            patched = apply_patch(copy.deepcopy(current), content_type, body)
            patched_rv = _meta(patched).get("resourceVersion")
            if patched_rv and patched_rv != current["metadata"]["resourceVersion"]:
                raise errors.conflict(rt.plural, name, rt.group)
            _meta(patched)["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self.update(
                rt, namespace, name, patched, subresource=subresource, keep_status=keep_status
            )

    def delete(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        *,
        precondition_rv: str | None = None,
        precondition_uid: str | None = None,
    ) -> dict[str, Any]:
        """Delete immediately (no finalizers/grace); namespaces take their contents with them."""
        with self._lock:
            current = self._current(rt, namespace, name)
            cur_meta = current["metadata"]
            if precondition_rv and precondition_rv != cur_meta["resourceVersion"]:
                raise errors.conflict(rt.plural, name, rt.group)
            if precondition_uid and precondition_uid != cur_meta["uid"]:
                raise errors.conflict(rt.plural, name, rt.group)
            if rt is NAMESPACES:
                for other in RESOURCE_TYPES:
                    if other.namespaced:
                        for key in sorted(self._bucket(other)):
                            if key[0] == name:
                                self._delete_key(other, key)
            return copy.deepcopy(self._delete_key(rt, self._key(rt, namespace, name)))

    def _delete_key(self, rt: ResourceType, key: Key) -> dict[str, Any]:
        old = self._bucket(rt).pop(key)
        gone = copy.deepcopy(old)
        if rt is NAMESPACES:
            gone.setdefault("status", {})["phase"] = "Terminating"
        self._bump(gone)
        self._commit(DELETED, rt, gone, old)
        return gone

    # -- watch -------------------------------------------------------------------------------

    def watch(
        self,
        rt: ResourceType,
        namespace: str | None,
        predicate: Predicate,
        resource_version: str | None,
    ) -> Watcher:
        """Register a watcher, pre-loaded with the events it must see first.

        No resourceVersion (or "0") means "current state, then changes": synthetic ADDED events
        for every matching object. Otherwise replay history after that version, or raise 410
        if it has been compacted away.
        """
        watcher = Watcher(rt, namespace, predicate)
        with self._lock:
            if not resource_version or resource_version == "0":
                for key, obj in sorted(self._bucket(rt).items()):
                    if (not namespace or key[0] == namespace) and predicate(obj):
                        watcher.queue.put((ADDED, obj))
            else:
                try:
                    since = int(resource_version)
                except ValueError:
                    raise errors.bad_request(
                        f"invalid resource version: {resource_version!r}"
                    ) from None
                if since < self._compacted_rv:
                    raise errors.expired(since, self._compacted_rv + 1)
                for event in self._history:
                    if event.rv > since:
                        watcher.offer(event)
            self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers.discard(watcher)

    def close_watchers(self) -> None:
        """Wake every watch stream so it ends (server shutdown)."""
        with self._lock:
            for watcher in self._watchers:
                watcher.queue.put(None)
            self._watchers.clear()

    @property
    def watcher_count(self) -> int:
        with self._lock:
            return len(self._watchers)

    def seed_namespaces(self, names: tuple[str, ...] = DEFAULT_NAMESPACES) -> None:
        for name in names:
            with self._lock:
                if ("", name) not in self._bucket(NAMESPACES):
                    self.create(NAMESPACES, None, {"metadata": {"name": name}})
