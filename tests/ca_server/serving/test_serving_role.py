"""The serving role (`ca_server.serving.role`), in process: what a single CA and a worker each
supply around the same gRPC services (the processes themselves: test_workers.py and the
monitoring tests)."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.config import CaConfig, WorkerRole
from ca_server.fleet import IssuedLeaves
from ca_server.metrics import CaMetrics
from ca_server.serving.readiness import SigningReadiness
from ca_server.serving.role import ServingView, SingleProcess, Worker, serving_role_for
from ca_server.serving.worker_status import decode_part
from certs import KeySpec, new_self_signed_authority
from meshca.clock import FakeClock

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _view(clock: FakeClock) -> ServingView:
    authority = new_self_signed_authority(
        KeySpec(), "cluster.local", now=NOW - timedelta(days=1), lifetime=timedelta(days=30)
    )
    return ServingView(
        authority=lambda: authority,
        leaves=IssuedLeaves(),
        slots=lambda: None,
        registry=CaMetrics().registry,
        readiness=SigningReadiness(lambda: authority, clock),
        started=NOW,
        clock=clock,
    )


def test_a_single_ca_owns_its_ports_and_a_worker_shares_them(tmp_path: Path):
    single = serving_role_for(CaConfig(data_dir=tmp_path))
    worker = serving_role_for(
        CaConfig(data_dir=tmp_path, worker=WorkerRole(2, tmp_path / "ready-2"))
    )
    assert isinstance(single, SingleProcess) and isinstance(worker, Worker)
    assert ("grpc.so_reuseport", 0) in single.server_options()
    assert ("grpc.so_reuseport", 1) in worker.server_options()


def test_a_single_ca_is_ready_only_while_it_serves_a_valid_chain(tmp_path: Path):
    clock = FakeClock(NOW)
    role = SingleProcess(CaConfig(data_dir=tmp_path, monitoring_listen="127.0.0.1:0"))
    role.start(_view(clock))
    try:
        assert role.readiness() == (503, "starting\n")
        asyncio.run(role.serving())
        assert role.readiness() == (200, "ready\n")
        clock.advance(timedelta(days=40))
        status, body = role.readiness()
        assert status == 503 and body.startswith("not ready: ")
        asyncio.run(role.leaving())
        assert role.readiness() == (503, "starting\n")
    finally:
        role.stop()


def test_a_worker_says_in_its_files_that_it_serves_and_takes_them_away(tmp_path: Path):
    clock = FakeClock(NOW)
    slot = WorkerRole(0, tmp_path / "ready-0")
    role = Worker(slot)
    view = _view(clock)

    async def serve_then_leave() -> tuple[str, str]:
        role.start(view)
        await role.serving()
        ready = slot.ready_file.read_text()
        clock.advance(timedelta(days=40))  # the chain expires: the supervisor must hear why
        view.readiness.problem()
        expired = slot.ready_file.read_text()
        await role.leaving()
        return ready, expired

    ready, expired = asyncio.run(serve_then_leave())
    assert ready == f"{os.getpid()}\n\n"
    assert expired.startswith(f"{os.getpid()}\nnot ready: ")
    assert not slot.ready_file.exists() and not slot.status_file.exists()


def test_a_worker_publishes_its_part_of_debug_ca_while_it_serves(tmp_path: Path):
    clock = FakeClock(NOW)
    slot = WorkerRole(1, tmp_path / "ready-1")
    role = Worker(slot)
    view = _view(clock)

    async def serve() -> bool:
        role.start(view)
        await role.serving()
        published = slot.status_file.exists()
        part = decode_part(slot.status_file.read_text())
        assert part.chain.cert == view.authority().cert
        await role.leaving()
        return published

    assert asyncio.run(serve())
