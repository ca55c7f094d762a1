"""The periodic report outlives what goes wrong with it: it is how an agent learns of a taint
between renewals (issue #9), so a report that hangs or an error nobody expected must cost one
period, never the rest of the agent's life. Real gRPC over TLS to an in-process CA whose report
service answers as each test scripts it; a real scheduler holding a real leaf."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from agent.ca_client import CaClient
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.propagation import PropagationReport
from agent.reporter import PeriodicReporter
from agent.scheduler import CertificateScheduler
from agent.secrets import SecretCache
from agent.token import FileTokenProvider
from ca_server.authority.slots import authority_id
from meshca.clock import SystemClock
from meshca_proto import report_pb2, report_pb2_grpc
from tests.support.agent_scheduler import scheduler_for
from tests.support.agent_wiring import until
from tests.support.fake_ca import IDENTITY, FakeCaServicer, FakeSigner, start_fake_ca
from tests.support.metrics import sample_value
from tests.support.pki import TestCa

INTERVAL = timedelta(seconds=0.3)
CLIENT_TIMEOUT = timedelta(seconds=30)  # a CSR's deadline: far longer than a report period


@dataclass
class ScriptedReports(report_pb2_grpc.AgentReportServiceServicer):
    """Answers each report with the taints it is given; `hang_first` calls never answer; while
    `shed` is set, refuses as a busy meshca CA does (`UNAVAILABLE` with a retry hint)."""

    tainted: dict[str, float] = field(default_factory=dict)
    hang_first: int = 0
    shed: bool = False
    received: int = 0

    async def Report(
        self, request: report_pb2.AgentReportRequest, context: grpc.aio.ServicerContext
    ) -> report_pb2.AgentReportResponse:
        self.received += 1
        if self.received <= self.hang_first:
            await asyncio.sleep(3600)
        if self.shed:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "200"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the CA is busy (test)")
        return report_pb2.AgentReportResponse(
            tainted=[
                report_pb2.TaintedAuthority(id=ident, seconds_since_taint=since)
                for ident, since in self.tainted.items()
            ]
        )


@dataclass
class Rig:
    reports: ScriptedReports
    reporter: PeriodicReporter
    scheduler: CertificateScheduler
    metrics: AgentMetrics
    authority: str  # the authority of the leaf the scheduler holds


@contextlib.asynccontextmanager
async def rig(
    tmp_path: Path, bundle_digest: Callable[[], str | None] = lambda: None
) -> AsyncIterator[Rig]:
    clock = SystemClock()
    pki = TestCa(datetime.now(UTC))
    reports = ScriptedReports()
    server, addr = await start_fake_ca(
        FakeCaServicer(pki, clock),
        tmp_path,
        clock.now(),
        also=lambda s: report_pb2_grpc.add_AgentReportServiceServicer_to_server(reports, s),
    )
    (tmp_path / "token").write_text("tok-123")
    metrics = AgentMetrics(clock)
    client = CaClient(
        addr,
        tmp_path / "root-cert.pem",
        FileTokenProvider(tmp_path / "token"),
        clock,
        timeout=CLIENT_TIMEOUT,
        metrics=metrics,
    )
    config = AgentConfig(secret_ttl=timedelta(hours=1), taint_resign_window=timedelta(0))
    cache = SecretCache()
    scheduler = scheduler_for(config, FakeSigner(pki, clock), cache, clock, metrics)
    running = asyncio.create_task(scheduler.run())
    scheduler.set_identities(frozenset({IDENTITY}))
    await until(lambda: scheduler.installs == 1)
    reporter = PeriodicReporter(
        client,
        scheduler,
        PropagationReport("agent-1", bundle_digest),
        clock,
        INTERVAL,
        metrics,
        random.Random(5),
    )
    reporting = asyncio.create_task(reporter.run())
    try:
        yield Rig(reports, reporter, scheduler, metrics, authority_id(pki.root))
    finally:
        for task in (reporting, running):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await scheduler.aclose()
        await client.close()
        await server.stop(None)


def reports_counted(metrics: AgentMetrics, outcome: str) -> float:
    exposition = generate_latest(metrics.registry).decode()
    return sample_value(exposition, "meshca_agent_reports_total", {"outcome": outcome})


def test_a_report_that_hangs_costs_one_period_not_the_csr_timeout(tmp_path: Path) -> None:
    """The CA takes the first report and never answers. The report's deadline is the period,
    so the next report goes out a period later and brings the taint; with the CSR's 30 s
    deadline the taint would wait 30 s."""

    async def main() -> None:
        async with rig(tmp_path) as r:
            r.reports.hang_first = 1
            r.reports.tainted = {r.authority: 0.0}
            await until(lambda: r.scheduler.installs == 2, timeout=5)  # re-signed for the taint
            assert r.reports.received >= 2
            assert reports_counted(r.metrics, "DEADLINE_EXCEEDED") == 1
            assert r.reporter.deadline == INTERVAL

    asyncio.run(main())


def test_an_unexpected_error_does_not_end_the_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception no handler names (here from building the report) is logged with its
    traceback and counted; the next period reports again, and so learns the taint."""
    calls = 0

    def digest_failing_once() -> str | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected: the bundle digest failed")
        return None

    async def main() -> None:
        async with rig(tmp_path, digest_failing_once) as r:
            r.reports.tainted = {r.authority: 0.0}
            await until(lambda: r.scheduler.installs == 2, timeout=5)
            assert reports_counted(r.metrics, "ERROR") == 1
            assert reports_counted(r.metrics, "OK") >= 1

    with caplog.at_level(logging.ERROR, logger="agent.reporter"):
        asyncio.run(main())
    assert "unexpected error sending the agent report" in caplog.text
    assert "injected: the bundle digest failed" in caplog.text


def test_a_busy_ca_shedding_reports_is_one_info_line_and_counted_unavailable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A CA under a certificate storm sheds reports (their lowest priority) with a retry hint.
    The agent just reports again next period: one INFO line for the whole busy stretch (no
    warning per period), each refusal counted as UNAVAILABLE, the CA counted as answering; once
    the CA takes reports again, one line says so and the taint it answers is acted on."""

    async def main() -> None:
        async with rig(tmp_path) as r:
            r.reports.shed = True
            await until(lambda: reports_counted(r.metrics, "UNAVAILABLE") >= 4, timeout=10)
            exposition = generate_latest(r.metrics.registry).decode()
            assert sample_value(exposition, "meshca_agent_ca_last_answer_timestamp_seconds") > 0
            assert (
                sample_value(exposition, "meshca_agent_ca_last_unanswered_timestamp_seconds") == 0
            )
            assert r.scheduler.installs == 1  # a shed report costs no certificate
            r.reports.tainted = {r.authority: 0.0}
            r.reports.shed = False
            await until(lambda: r.scheduler.installs == 2, timeout=5)
            assert reports_counted(r.metrics, "OK") >= 1

    with caplog.at_level(logging.DEBUG, logger="agent.reporter"):
        asyncio.run(main())
    said = [
        (record.levelno, record.getMessage())
        for record in caplog.records
        if record.name == "agent.reporter" and record.levelno >= logging.INFO
    ]
    assert len(said) == 2, said
    (busy_level, busy), (back_level, back) = said
    assert busy_level == logging.INFO and "the CA is busy and shed the agent report" in busy
    assert "UNAVAILABLE" in busy
    assert back_level == logging.INFO and "succeeded again" in back
    quiet = [r for r in caplog.records if r.name == "agent.reporter" and r.levelno == logging.DEBUG]
    assert len(quiet) >= 3  # the later refusals, each a debug line only


def test_a_failure_while_the_ca_is_busy_still_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shedding is said at INFO; a real failure after it (here the token file going away) is
    a warning of its own, once."""

    async def main() -> None:
        async with rig(tmp_path) as r:
            r.reports.shed = True
            await until(lambda: reports_counted(r.metrics, "UNAVAILABLE") >= 2, timeout=10)
            (tmp_path / "token").unlink()
            await until(lambda: reports_counted(r.metrics, "ERROR") >= 3, timeout=10)

    with caplog.at_level(logging.INFO, logger="agent.reporter"):
        asyncio.run(main())
    levels = [r.levelno for r in caplog.records if r.name == "agent.reporter"]
    assert levels == [logging.INFO, logging.WARNING], caplog.text
