"""Issue #17 Done means 1: a report larger than any agent sends is refused with INVALID_ARGUMENT
before any of its lists is walked. A real gRPC server with the real `AgentReportService` and
`AgentReports`; the proof is a count of the values matched against their patterns
(`ca_server.fleet.entries.valid`, wrapped), not a timing."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
import pytest

import ca_server.fleet.entries as entries
from ca_server.admission import Admission
from ca_server.authn import AuthenticatorChain, AuthnRequest, Caller
from ca_server.config import AdmissionPolicy
from ca_server.fleet.agent_reports import AgentReports
from ca_server.metrics import CaMetrics
from ca_server.report_service import MAX_REPORT_BYTES, AgentReportService, add_report_service
from meshca.clock import SystemClock
from meshca_proto import report_pb2
from tests.support.agent_reports import pod_caller

NOW = datetime(2026, 12, 1, tzinfo=UTC)


@dataclass
class _PodToken:
    """Every caller is the pod `default/web-0` (authentication is not what is tested here)."""

    name: str = "pod-token"

    async def authenticate(self, request: AuthnRequest) -> Caller:
        return pod_caller("web-0")


@pytest.fixture
def validated(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str | None]]:
    """Every value the report code matches against a pattern, in order."""
    seen: list[str | None] = []
    real = entries.valid

    def counting(value: str | None, pattern: re.Pattern[str], longest: int) -> str | None:
        seen.append(value)
        return real(value, pattern, longest)

    monkeypatch.setattr(entries, "valid", counting)
    yield seen


async def _send(reports: AgentReports, payload: bytes) -> grpc.StatusCode:
    clock = SystemClock()
    service = AgentReportService(
        authenticators=AuthenticatorChain([_PodToken()]),
        reports=reports,
        tainted_since=dict,
        metrics=CaMetrics(),
        clock=clock,
        admission=Admission(AdmissionPolicy(), clock.monotonic),
    )
    server = grpc.aio.server()
    add_report_service(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                "/meshca.v1.AgentReportService/Report",
                request_serializer=None,
                response_deserializer=report_pb2.AgentReportResponse.FromString,
            )
            try:
                await call(payload, timeout=20)
            except grpc.aio.AioRpcError as exc:
                assert exc.details(), "a refusal says what to fix"
                return exc.code()
            return grpc.StatusCode.OK
    finally:
        await server.stop(None)


def _request(
    agent_id: str = "a-1",
    trust_bundle_sha256: str = "ab" * 32,
    leaf_authorities: tuple[str, ...] = (),
) -> bytes:
    request = report_pb2.AgentReportRequest(
        agent_id=agent_id,
        trust_bundle_sha256=trust_bundle_sha256,
        leaf_authorities=leaf_authorities,
    )
    return request.SerializeToString()


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(_request(leaf_authorities=("ab" * 20,) * 50_000), id="50k-authorities"),
        pytest.param(_request(leaf_authorities=("ab" * 20,) * 9), id="9-authorities"),
        pytest.param(_request(leaf_authorities=("ab" * 100,)), id="long-authority"),
        pytest.param(_request(agent_id="a" * 300), id="long-agent-id"),
        pytest.param(_request(trust_bundle_sha256="ab" * 33), id="long-digest"),
    ],
)
def test_an_oversized_report_is_refused_before_any_value_is_matched(
    payload: bytes, validated: list[str | None]
) -> None:
    reports = AgentReports()
    assert asyncio.run(_send(reports, payload)) == grpc.StatusCode.INVALID_ARGUMENT
    assert validated == [], f"{len(validated)} values of a refused report were walked"
    assert len(reports) == 0 and not reports.changed


def test_the_largest_valid_report_is_recorded_and_its_values_are_checked(
    validated: list[str | None],
) -> None:
    """The counter is live: an accepted report's values are matched (so the test above could
    fail), and one at the caps fits the byte limit with room to spare."""
    payload = _request(agent_id="a" * 253, leaf_authorities=("ab" * 64,) * 8)
    assert len(payload) < MAX_REPORT_BYTES / 2
    reports = AgentReports()
    assert asyncio.run(_send(reports, payload)) == grpc.StatusCode.OK
    assert len(validated) >= 8 + 2
    assert len(reports) == 1
