"""A worker's view of its supervisor's cluster-wide caches (`ca_server.kube.cache_service`):
the same `PodLookup` and `AccountLookup` a single CA gets from its own caches, each lookup one
round trip on a Unix socket.

Every answer carries the caches' state, kept here, and while a cache is still listing a thread
asks for it every `_STATE_POLL_SECONDS`: `synced` and `progress` never wait on the socket, and
once a cache has synced it stays synced (the informer never forgets it).
A lookup that cannot reach the supervisor (it is stopping: the worker follows it) is
`DependencyUnavailableError`, which clients retry.

Concurrency: callers on any thread (the fleet's merge in worker threads; the request path through
the `fetch` methods, which run the round trip in the default thread pool so the event loop never
waits on the socket); each thread has its own connection, so no lookup waits for another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from pathlib import Path
from typing import Any

from ca_server.errors import DependencyUnavailableError
from ca_server.kube.cache_service import MAX_BATCH
from ca_server.kube.watched_cache import CacheProgress
from meshca.pods import PodInfo, shared_signers

_TIMEOUT_SECONDS = 5.0
_STATE_POLL_SECONDS = 0.25


class _Connection:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(_TIMEOUT_SECONDS)
        try:
            self.sock.connect(str(path))
        except OSError:
            self.sock.close()
            raise
        self.reader = self.sock.makefile("rb")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class RemoteKubeCaches:
    """Both lookups over one socket path; `pods` and `accounts` are the views to hand out."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._local = threading.local()
        # [pods synced, pods objects, accounts synced, accounts objects, changes]
        self._state: list[Any] = [False, 0, False, 0, 0]
        self.pods = RemotePodCache(self)
        self.accounts = RemoteAccountCache(self)
        self._stopping = threading.Event()
        self._follower = threading.Thread(
            target=self._follow_state, name="kube-cache-state", daemon=True
        )

    def start(self, pods: bool, accounts: bool) -> None:
        """Follows the state until the caches this worker needs have synced."""
        self._needs = (pods, accounts)
        self._follower.start()

    def stop(self) -> None:
        self._stopping.set()

    def _follow_state(self) -> None:
        pods, accounts = self._needs
        while not self._stopping.is_set():
            state = self._state
            if (state[0] or not pods) and (state[2] or not accounts):
                return
            # The supervisor may be starting or stopping: ask again.
            with contextlib.suppress(DependencyUnavailableError):
                self.call("state")
            self._stopping.wait(_STATE_POLL_SECONDS)

    def call(self, *request: Any) -> Any:
        """One request's result; refreshes the state."""
        payload = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        connection: _Connection | None = getattr(self._local, "connection", None)
        try:
            if connection is None:
                connection = _Connection(self._path)
                self._local.connection = connection
            connection.sock.sendall(payload)
            line = connection.reader.readline()
            if not line:
                raise ConnectionResetError("the supervisor closed the connection")
        except OSError as exc:
            if connection is not None:
                connection.close()
            self._local.connection = None
            raise DependencyUnavailableError(
                "kube-cache-unavailable",
                f"this CA worker could not ask its supervisor's Kubernetes caches ({exc}); "
                "retry shortly",
            ) from None
        answer = json.loads(line)
        if isinstance(answer, dict):
            raise DependencyUnavailableError(
                "kube-cache-unavailable", f"the supervisor's caches refused a lookup: {answer}"
            )
        self._state = answer[0]
        return answer[1]

    def state(self, fresh: bool = False) -> list[Any]:
        """The last state seen; `fresh` asks first (a round trip)."""
        if fresh:
            self.call("state")
        return self._state


def _pod(namespace: str, name: str, wire: Any) -> PodInfo | None:
    if wire is None:
        return None
    uid, account, node, phase, signers = wire
    return PodInfo(namespace, name, uid, account, node, phase, shared_signers(signers))


class RemotePodCache:
    def __init__(self, caches: RemoteKubeCaches) -> None:
        self._caches = caches

    @property
    def synced(self) -> bool:
        return bool(self._caches.state()[0])

    @property
    def changes(self) -> int:
        return int(self._caches.state(True)[4])

    def progress(self) -> CacheProgress:
        state = self._caches.state()
        return CacheProgress("pods", bool(state[0]), int(state[1]))

    def get(self, namespace: str, name: str) -> PodInfo | None:
        return _pod(namespace, name, self._caches.call("pod", namespace, name))

    def get_many(self, keys: list[tuple[str, str]]) -> list[PodInfo | None]:
        found: list[PodInfo | None] = []
        for start in range(0, len(keys), MAX_BATCH):
            batch = keys[start : start + MAX_BATCH]
            wires = self._caches.call("pods", [list(key) for key in batch])
            found.extend(
                _pod(ns, name, wire) for (ns, name), wire in zip(batch, wires, strict=True)
            )
        return found

    def runs_on_node(self, node_name: str, namespace: str, service_account: str) -> bool:
        return bool(self._caches.call("on_node", node_name, namespace, service_account))

    async def fetch(self, namespace: str, name: str) -> PodInfo | None:
        return await asyncio.to_thread(self.get, namespace, name)

    async def fetch_runs_on_node(self, node_name: str, namespace: str, account: str) -> bool:
        return await asyncio.to_thread(self.runs_on_node, node_name, namespace, account)


class RemoteAccountCache:
    def __init__(self, caches: RemoteKubeCaches) -> None:
        self._caches = caches

    @property
    def synced(self) -> bool:
        return bool(self._caches.state()[2])

    def progress(self) -> CacheProgress:
        state = self._caches.state()
        return CacheProgress("serviceaccounts", bool(state[2]), int(state[3]))

    def uid(self, namespace: str, name: str) -> str | None:
        uid = self._caches.call("account", namespace, name)
        return str(uid) if uid is not None else None

    async def fetch_uid(self, namespace: str, name: str) -> str | None:
        return await asyncio.to_thread(self.uid, namespace, name)
