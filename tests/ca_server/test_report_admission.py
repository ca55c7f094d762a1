"""Agent reports under admission control: the lowest priority of the one policy.

A real gRPC server (the in-process CA, `tests/support/inprocess_ca.py`) with the real
`CertificateService` and `AgentReportService` sharing one `Admission`, as `meshca ca` wires them.
The authenticator holds the requests a test marks (`x-test-hold: 1`) until the test releases
them, so "N requests in flight" is a state the test sets up and observes, not a race against a
sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import generate_latest

from ca_server.admission import Admission
from ca_server.authn import AuthenticatorChain, AuthnRequest, Caller
from ca_server.config import AdmissionPolicy
from ca_server.errors import OverloadedError
from ca_server.fleet.agent_reports import AgentReports
from ca_server.metrics import CaMetrics
from ca_server.report_service import AgentReportService, add_report_service, no_taints
from ca_server.wire import RETRY_PUSHBACK_TRAILER
from certs import SpiffeId, build_csr, generate_private_key
from meshca.clock import SystemClock
from meshca_proto import ca_pb2, ca_pb2_grpc, report_pb2
from tests.support.inprocess_ca import InProcessCa
from tests.support.metrics import sample_value

IDENTITY = SpiffeId("cluster.local", "default", "reporter")
HOLD = ("x-test-hold", "1")
POLICY = AdmissionPolicy(max_in_flight=20, max_in_flight_renewals=10, max_in_flight_reports=4)


def test_reports_come_after_every_certificate_request_and_take_no_certificate_slot():
    admission = Admission(POLICY, time.monotonic)
    reports = [admission.admit_report() for _ in range(4)]
    with pytest.raises(OverloadedError) as refused:
        admission.admit_report()
    assert refused.value.reason == "overloaded-report"
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "4 requests in flight, limit 4 for agent reports" in refused.value.message
    assert refused.value.retry_after_ms >= 50
    # Four reports in flight leave every certificate slot free: 10 renewals, then first
    # certificates up to 20.
    renewals = [admission.admit(renewal=True) for _ in range(10)]
    first = [admission.admit(renewal=False) for _ in range(10)]
    assert (admission.in_flight, admission.reports_in_flight) == (20, 4)
    with pytest.raises(OverloadedError):
        admission.admit(renewal=False)
    for ticket in reports + renewals + first:
        ticket.release()
        ticket.release()  # idempotent
    assert (admission.in_flight, admission.reports_in_flight) == (0, 0)
    # Certificate requests in flight shut reports out from the reports' level on.
    certificates = [admission.admit(renewal=False) for _ in range(4)]
    with pytest.raises(OverloadedError):
        admission.admit_report()
    certificates.pop().release()
    admission.admit_report().release()
    for ticket in certificates:
        ticket.release()


def test_the_reports_level_defaults_to_a_quarter_and_never_exceeds_the_renewals_level():
    assert AdmissionPolicy().reports_limit == 32
    assert AdmissionPolicy(max_in_flight=3, max_in_flight_renewals=1).reports_limit == 1
    assert AdmissionPolicy(max_in_flight=100, max_in_flight_renewals=10).reports_limit == 10
    with pytest.raises(ValueError, match="0 < reports <= renewals"):
        AdmissionPolicy(max_in_flight=20, max_in_flight_renewals=10, max_in_flight_reports=11)


@dataclass
class _HeldAuthenticator:
    """Accepts every caller; a request carrying `x-test-hold: 1` waits for `release` first.
    `calls` counts authentications (a report shed by admission must cost none)."""

    name: str = "held"
    release: asyncio.Event = field(default_factory=asyncio.Event)
    calls: int = 0

    async def authenticate(self, request: AuthnRequest) -> Caller:
        self.calls += 1
        if request.headers.get(HOLD[0]) == HOLD[1]:
            await self.release.wait()
        return Caller(identity=IDENTITY, authenticator=self.name, subject="system:test")


@dataclass
class _Ca:
    admission: Admission
    authenticator: _HeldAuthenticator
    metrics: CaMetrics
    channel: grpc.aio.Channel

    async def csr(self, *headers: tuple[str, str]) -> grpc.StatusCode:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(self.channel)
        request = ca_pb2.IstioCertificateRequest(csr=build_csr(generate_private_key(), IDENTITY))
        try:
            await stub.CreateCertificate(request, metadata=headers, timeout=20)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def report(self, *headers: tuple[str, str]) -> grpc.aio.AioRpcError | None:
        call = self.channel.unary_unary(
            "/meshca.v1.AgentReportService/Report",
            request_serializer=report_pb2.AgentReportRequest.SerializeToString,
            response_deserializer=report_pb2.AgentReportResponse.FromString,
        )
        try:
            await call(report_pb2.AgentReportRequest(agent_id="a-1"), metadata=headers, timeout=20)
        except grpc.aio.AioRpcError as exc:
            return exc
        return None

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return sample_value(generate_latest(self.metrics.registry).decode(), name, labels)


@asynccontextmanager
async def _ca() -> AsyncIterator[_Ca]:
    admission = Admission(POLICY, SystemClock().monotonic)
    authenticator = _HeldAuthenticator()

    def add_report_service_to(ca: InProcessCa, server: grpc.aio.Server) -> None:
        add_report_service(
            AgentReportService(
                authenticators=ca.authenticators,
                reports=AgentReports(),
                tainted_since=no_taints,
                metrics=ca.metrics,
                clock=ca.clock,
                admission=admission,
            ),
            server,
        )

    async with InProcessCa(
        authenticators=AuthenticatorChain([authenticator]),
        admission=admission,
        tls=False,
        rpc_server="aio",
        add_services=add_report_service_to,
    ) as ca:
        try:
            async with grpc.aio.insecure_channel(ca.addr) as channel:
                yield _Ca(admission, authenticator, ca.metrics, channel)
        finally:
            authenticator.release.set()


async def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def _assert_shed(error: grpc.aio.AioRpcError | None) -> None:
    assert error is not None, "the report must be refused"
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "agent reports" in (error.details() or "")
    hints = dict(error.trailing_metadata() or ())
    assert 50 <= int(hints[RETRY_PUSHBACK_TRAILER]) <= 30_000


def test_a_ca_busy_with_certificates_refuses_a_report_at_once_and_still_takes_a_csr():
    async def scenario() -> None:
        async with _ca() as ca:
            assert await ca.report() is None  # not busy: answered
            held = [asyncio.create_task(ca.csr(HOLD)) for _ in range(8)]
            await _until(lambda: ca.admission.in_flight == 8, "8 CSRs in flight")
            authentications = ca.authenticator.calls

            started = time.monotonic()
            shed = await ca.report()
            refused_in = time.monotonic() - started
            _assert_shed(shed)
            assert ca.authenticator.calls == authentications, "shed before authentication"
            assert refused_in < 1.0, refused_in  # at once, not after the held CSRs
            # A CSR arriving now is admitted and answered while the 8 are still held.
            assert await ca.csr() == grpc.StatusCode.OK
            assert ca.admission.in_flight == 8

            ca.authenticator.release.set()
            assert await asyncio.gather(*held) == [grpc.StatusCode.OK] * 8
            assert await ca.report() is None  # no longer busy: answered again

            assert ca.metric("meshca_ca_agent_reports_total", {"outcome": "recorded"}) == 2
            outcome = {"outcome": "overloaded-report"}
            assert ca.metric("meshca_ca_agent_reports_total", outcome) == 1
            assert ca.metric("meshca_ca_requests_shed_total", {"kind": "report"}) == 1
            assert ca.metric("meshca_ca_requests_shed_total", {"kind": "first"}) == 0
            assert ca.metric("meshca_ca_certificates_issued_total") == 9
            # A shed report is not a refused certificate on Istio's dashboards.
            assert ca.metric("citadel_server_csr_count") == 9

    asyncio.run(scenario())


def test_reports_in_flight_never_make_a_csr_wait_or_be_refused():
    """Reports fill their level and hang in authentication (a slow TokenReview). A burst of
    exactly `max_in_flight` CSRs is then admitted whole: reports hold no certificate slot. Only
    the next CSR beyond the certificates' own bound is shed, and further reports are."""

    async def scenario() -> None:
        async with _ca() as ca:
            reports = [asyncio.create_task(ca.report(HOLD)) for _ in range(4)]
            await _until(lambda: ca.admission.reports_in_flight == 4, "4 reports in flight")
            _assert_shed(await ca.report())

            csrs = [asyncio.create_task(ca.csr(HOLD)) for _ in range(20)]
            await _until(lambda: ca.admission.in_flight == 20, "20 CSRs in flight")
            assert await ca.csr() == grpc.StatusCode.UNAVAILABLE  # the certificates' own bound
            _assert_shed(await ca.report())

            ca.authenticator.release.set()
            assert await asyncio.gather(*csrs) == [grpc.StatusCode.OK] * 20
            assert await asyncio.gather(*reports) == [None] * 4
            assert ca.metric("meshca_ca_requests_shed_total", {"kind": "first"}) == 1
            assert ca.metric("meshca_ca_requests_shed_total", {"kind": "report"}) == 2
            assert (ca.admission.in_flight, ca.admission.reports_in_flight) == (0, 0)

    asyncio.run(scenario())
