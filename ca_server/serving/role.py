"""The serving role, chosen once at start-up: a single CA process, or worker `slot` of a
`meshca ca --workers N` supervisor (`CaConfig.worker` set; see `ca_server.serving.workers`).

The two serve the same gRPC services the same way; they differ only in what surrounds them,
and that is all a role supplies:

- At start (`prepare`): a worker asks to die with its supervisor (`die_with_parent`).
- gRPC options: a single CA owns its ports (`so_reuseport` off: a second CA on the same port
  fails loudly); a worker shares them with its siblings (`so_reuseport` on).
- `/metrics`, `/healthz`, `/ready`: a single CA serves them on `--monitoring-listen`; a worker
  has none (its supervisor serves them for all workers).
- `/debug/ca`: a single CA serves it on `--debug-listen` when given; a worker publishes its part
  to the supervisor instead (`ca_server.serving.worker_status`).
- Readiness: a single CA's `/ready` asks `SigningReadiness`; a worker writes its ready file (its
  pid, then why it is not ready), which the supervisor's `/ready` reads.

The role sees the running CA only through a `ServingView` of plain inputs (a callable returning
the current authority, the leaves registry, a provider of the authority slots' report, the
metrics registry, the signing readiness), never the authority modules, so how the authority is
driven and how the process is served change independently.

Life (`ca_server.server._serve` calls these in this order): `prepare()` first thing;
`server_options()` for `grpc.aio.server`; `start(view)` once the ports are bound, before the
gRPC server starts (binds and starts the HTTP servers); `await serving()` once the gRPC server
serves; at shutdown `await leaving()` (after the validity watch stopped: it may rewrite the
ready file) and `stop()` after the gRPC server stopped.

Concurrency: everything but the HTTP servers runs on the CA's event loop (file writes in a
worker thread); the monitoring and debug servers run in their own threads and only read the
view and the `ready` flag.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from ca_server.config import CaConfig, WorkerRole
from ca_server.fleet import IssuedLeaves
from ca_server.serving.readiness import SigningReadiness
from ca_server.serving.status import SigningChain, ca_document
from ca_server.serving.worker_status import SlotsSnapshot, WorkerStatusPublisher
from ca_server.serving.workers import die_with_parent
from meshca.clock import Clock
from meshca.files import atomic_write
from meshca.status_http import StatusServer, json_response, metrics_route, text
from meshca.waiting import cancel_and_wait

MAX_MESSAGE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ServingView:
    """What a role shows and publishes of the running CA."""

    authority: Callable[[], SigningChain]  # the current signing authority
    leaves: IssuedLeaves  # the leaves this process signed (`CaMetrics.leaves`)
    slots: Callable[[], SlotsSnapshot | None]  # the authority slots' report; `None` without
    registry: CollectorRegistry  # `/metrics`
    readiness: SigningReadiness
    started: datetime
    clock: Clock
    # Kubernetes mode's cluster-wide caches: whether they have synced (until then `/ready` is
    # 503, though the CA serves what needs no cache), and their progress for `/ready`'s body.
    caches_synced: Callable[[], bool] = lambda: True
    detail: Callable[[], str] = lambda: ""
    # The JWT-SVID keys and discovery endpoint (`ca_server.jwt_svid.status_section`).
    jwt: Callable[[], dict[str, Any] | None] = lambda: None


class ServingRole(Protocol):
    def prepare(self) -> None:
        """First thing at start-up, before anything is read or written."""

    def server_options(self) -> list[tuple[str, int]]:
        """The options of `grpc.aio.server`."""

    def start(self, view: ServingView) -> None:
        """Once the gRPC ports are bound, before the server starts: the HTTP servers."""

    async def serving(self) -> None:
        """The gRPC server serves: say so (`/ready`, or the ready file)."""

    async def leaving(self) -> None:
        """Shutdown began: stop saying ready, stop publishing."""

    def stop(self) -> None:
        """The gRPC server stopped: the HTTP servers stop."""


def serving_role_for(config: CaConfig) -> ServingRole:
    return Worker(config.worker) if config.worker is not None else SingleProcess(config)


def _options(reuse_port: bool) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


class SingleProcess:
    """A CA on its own: it owns its ports and serves its own monitoring and debug pages."""

    def __init__(self, config: CaConfig) -> None:
        self._config = config
        self._view: ServingView | None = None
        self._servers: list[StatusServer] = []
        self.ready = False  # serving, and not shutting down

    def prepare(self) -> None:
        pass

    def server_options(self) -> list[tuple[str, int]]:
        """A single CA owns its ports: a second one on the same port fails to start, loudly."""
        return _options(reuse_port=False)

    def readiness(self) -> tuple[int, str]:
        """`/ready`: 200 once serving, while the signing chain is valid and the cluster-wide
        caches have synced; else 503 and why (the caches' progress below)."""
        if not self.ready or self._view is None:
            return 503, "starting\n"
        problem = self._view.readiness.problem()
        detail = self._view.detail()
        if problem:
            return 503, f"not ready: {problem}\n{detail}"
        if not self._view.caches_synced():
            return 503, f"syncing\n{detail}"
        return 200, f"ready\n{detail}"

    def start(self, view: ServingView) -> None:
        self._view = view
        self._servers = [self._monitoring(view)]
        if self._config.debug_listen is not None:
            self._servers.append(self._debug(view, self._config.debug_listen))
        for server in self._servers:
            server.start()

    def _monitoring(self, view: ServingView) -> StatusServer:
        """`/metrics`, `/healthz` and `/ready`. No identities or serials here: those are on the
        debug address only."""
        return StatusServer(
            self._config.monitoring_listen,
            {
                "/metrics": metrics_route(view.registry),
                "/healthz": lambda: text(200, "ok\n"),
                "/ready": lambda: text(*self.readiness()),
            },
        )

    @staticmethod
    def _debug(view: ServingView, listen: str) -> StatusServer:
        """`/debug/ca` (workload identities and serials, what `meshca status` reads) and
        `/metrics` (its rates) on `--debug-listen`."""

        def document() -> dict[str, object]:
            slots = view.slots()
            document = ca_document(
                view.authority(),
                view.leaves,
                view.started,
                view.clock.now(),
                slots.section if slots is not None else None,
            )
            document["jwt_svid"] = view.jwt()
            return document

        return StatusServer(
            listen,
            {
                "/metrics": metrics_route(view.registry),
                "/debug/ca": lambda: json_response(document()),
            },
            name="debug",
            flag="--debug-listen",
        )

    async def serving(self) -> None:
        self.ready = True

    async def leaving(self) -> None:
        self.ready = False

    def stop(self) -> None:
        for server in self._servers:
            server.stop()


class Worker:
    """Worker `slot` of a supervisor, which serves `/metrics`, `/ready` and `/debug/ca` for all
    its workers: this process shares the ports, publishes its part of `/debug/ca` and tells the
    supervisor it is serving (and, later, why not) through its ready file."""

    def __init__(self, worker: WorkerRole) -> None:
        self._worker = worker
        self._publisher: WorkerStatusPublisher | None = None
        self._publishing: asyncio.Task[None] | None = None
        self._readiness: SigningReadiness | None = None

    def prepare(self) -> None:
        die_with_parent()

    def server_options(self) -> list[tuple[str, int]]:
        """Workers share their ports with their siblings: the kernel spreads connections."""
        return _options(reuse_port=True)

    def start(self, view: ServingView) -> None:
        self._readiness = view.readiness
        self._publisher = WorkerStatusPublisher(
            self._worker.status_file, view.authority, view.leaves, view.clock, slots=view.slots
        )

    async def serving(self) -> None:
        assert self._publisher is not None and self._readiness is not None, "start() first"
        # Published before the ready file, so the supervisor's `/debug/ca` answers once
        # `/ready` does.
        await asyncio.to_thread(self._publisher.publish)
        self._publishing = asyncio.create_task(self._publisher.run())
        ready_file = self._worker.ready_file
        atomic_write(ready_file, ready_file_text(None))
        self._readiness.on_change = lambda problem: atomic_write(
            ready_file, ready_file_text(problem)
        )

    async def leaving(self) -> None:
        self._worker.ready_file.unlink(missing_ok=True)
        await cancel_and_wait(self._publishing)
        if self._publisher is not None:
            self._publisher.remove()

    def stop(self) -> None:
        pass


def ready_file_text(problem: str | None) -> bytes:
    """A worker's ready file: its pid, then why it is not ready (read by `workers._Slot`)."""
    return f"{os.getpid()}\n{f'not ready: {problem}' if problem else ''}\n".encode()
