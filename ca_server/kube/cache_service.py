"""The supervisor's side of `--workers N`: its one set of cluster-wide caches, answering the
workers' lookups over a Unix socket in its private run directory.

Why one cache answered over a socket and not one per worker: at 60,000 pods a cache is tens of
megabytes and its list and watch a real load on the API server; N copies multiply both by N.
Why lookups and not a shared snapshot: a new pod asks for its certificate as soon as it starts,
so a lookup must see the watch's latest event, and a lookup is a few tens of microseconds on a
Unix socket (the fleet-scale bench measures the request path end to end).

The protocol, one JSON document per line each way (`ca_server.kube.cache_client` is the only
client): a request is `[op, args...]`; the answer is `[state, result]`, `state` being
`[pods synced, pods held or listed, accounts synced, accounts held or listed, changes]` so a
worker learns the caches' progress with every answer, or `{"error": why}` for a request it
cannot read (the connection stays open). Ops: `state`; `pod ns name` → `[uid, service account,
node, phase, [podCertificate signers]]` or null; `pods [[ns, name], ...]` (at most
`MAX_BATCH`) → a list of those; `on_node node ns account` → bool; `account ns name` → uid or
null.

The socket lives in the supervisor's fresh 0700 run directory, so only the CA's own user can
reach it, and `bind` refuses a path that exists: it never takes over another socket.

Concurrency: one thread per worker connection (`socketserver`); lookups take the caches' locks
for a dictionary read.
"""

from __future__ import annotations

import json
import logging
import socketserver
import threading
from pathlib import Path
from typing import Any

from ca_server.kube.caches import LocalKubeCaches
from meshca.pods import PodInfo

log = logging.getLogger(__name__)

MAX_BATCH = 1_000
MAX_REQUEST_BYTES = 256 * 1024  # a full batch of the longest names fits


def pod_wire(pod: PodInfo | None) -> list[Any] | None:
    if pod is None:
        return None
    return [
        pod.uid,
        pod.service_account,
        pod.node_name,
        pod.phase,
        list(pod.pod_certificate_signers),
    ]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


class _Answering(socketserver.StreamRequestHandler):
    server: _UnixServer

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
            if not line:
                return
            if not line.endswith(b"\n"):
                self._send({"error": f"a request longer than {MAX_REQUEST_BYTES} bytes"})
                return
            try:
                answer: Any = self.server.owner.answer(json.loads(line))
            except (ValueError, TypeError, IndexError) as exc:
                answer = {"error": f"unreadable request: {exc}"}
            self._send(answer)

    def _send(self, answer: Any) -> None:
        self.wfile.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    owner: KubeCacheServer


class KubeCacheServer:
    """Serves `caches` on `path` from a background thread until `stop()`."""

    def __init__(self, caches: LocalKubeCaches, path: Path) -> None:
        self._caches = caches
        self.path = path
        self._server = _UnixServer(str(path), _Answering)
        self._server.owner = self
        path.chmod(0o600)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kube-cache-server", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)

    def state(self) -> list[Any]:
        pods, accounts = self._caches.pods, self._caches.accounts
        pod_progress = pods.progress() if pods is not None else None
        account_progress = accounts.progress() if accounts is not None else None
        return [
            pod_progress.synced if pod_progress else False,
            pod_progress.objects if pod_progress else 0,
            account_progress.synced if account_progress else False,
            account_progress.objects if account_progress else 0,
            pods.changes if pods is not None else 0,
        ]

    def answer(self, request: Any) -> Any:
        if not isinstance(request, list) or not request:
            raise ValueError("expected [op, args...]")
        op, args = request[0], request[1:]
        return [self.state(), self._result(op, args)]

    def _result(self, op: Any, args: list[Any]) -> Any:
        pods, accounts = self._caches.pods, self._caches.accounts
        if op == "state":
            return None
        if op == "pod" and pods is not None:
            return pod_wire(pods.get(_text(args[0]), _text(args[1])))
        if op == "pods" and pods is not None:
            keys = args[0]
            if not isinstance(keys, list) or len(keys) > MAX_BATCH:
                raise ValueError(f"expected a list of at most {MAX_BATCH} [namespace, name]")
            wanted = [(_text(key[0]), _text(key[1])) for key in keys]
            return [pod_wire(pod) for pod in pods.get_many(wanted)]
        if op == "on_node" and pods is not None:
            return pods.runs_on_node(_text(args[0]), _text(args[1]), _text(args[2]))
        if op == "account" and accounts is not None:
            return accounts.uid(_text(args[0]), _text(args[1]))
        raise ValueError(f"unknown op {op!r} (or a cache this CA does not hold)")
