"""Admission control: the in-flight limit, renewals shed first, and the retry hint on the wire."""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from agent.ca_client import CaClient
from agent.metrics import AgentMetrics
from agent.signing import SigningRequest
from agent.token import FileTokenProvider
from ca_server.admission import Admission, is_renewal
from ca_server.authn import AuthenticatorChain, AuthnRequest, Caller
from ca_server.config import AdmissionPolicy
from ca_server.errors import OverloadedError
from ca_server.metrics import CaMetrics
from ca_server.wire import RETRY_PUSHBACK_TRAILER
from certs import SpiffeId, build_csr, generate_private_key
from meshca.clock import SystemClock
from meshca_proto import ca_pb2, ca_pb2_grpc
from tests.support.inprocess_ca import InProcessCa
from tests.support.metrics import sample_value


class _Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_certificates_may_use_every_slot_renewals_only_their_share():
    admission = Admission(AdmissionPolicy(max_in_flight=3, max_in_flight_renewals=1), _Ticks())
    renewal = admission.admit(renewal=True)
    with pytest.raises(OverloadedError) as refused:
        admission.admit(renewal=True)
    assert refused.value.reason == "overloaded-renewal"
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    first = [admission.admit(renewal=False), admission.admit(renewal=False)]
    with pytest.raises(OverloadedError) as full:
        admission.admit(renewal=False)
    assert full.value.reason == "overloaded"
    assert "3 requests in flight, limit 3" in full.value.message
    for ticket in (renewal, *first):
        ticket.release()
        ticket.release()  # idempotent: a slot is returned once
    assert admission.in_flight == 0
    admission.admit(renewal=True).release()


def test_the_retry_hint_is_the_time_to_drain_the_queue_at_the_observed_rate():
    ticks = _Ticks()
    admission = Admission(AdmissionPolicy(max_in_flight=5000, max_in_flight_renewals=10), ticks)
    tickets = [admission.admit(renewal=False) for _ in range(400)]
    for ticket in tickets[:200]:  # one completion every 10 ms: 100 per second
        ticks.now += 0.01
        ticket.release()
    # 200 left at 100/s: about 2 s; renewals are told to wait four times longer.
    assert 1_800 <= admission.retry_hint_ms(renewal=False) <= 2_200
    assert 7_200 <= admission.retry_hint_ms(renewal=True) <= 8_800
    for ticket in tickets[200:]:
        ticket.release()
    assert admission.retry_hint_ms(renewal=False) == 50  # nothing queued: the floor

    # An idle hour does not count as slow draining: the rate is measured over busy time.
    ticks.now += 3600
    more = [admission.admit(renewal=False) for _ in range(100)]
    ticks.now += 0.01
    more[0].release()
    assert 800 <= admission.retry_hint_ms(renewal=False) <= 1_200
    # A huge queue is capped: a client should not idle long after the queue has drained.
    huge = [admission.admit(renewal=False) for _ in range(4000)]
    assert admission.retry_hint_ms(renewal=False) == 30_000
    for ticket in more[1:] + huge:
        ticket.release()


def test_clients_already_told_to_wait_lengthen_the_hint():
    """10 in flight draining at 100/s is 0.1 s of queue; but 2,000 refusals a second mean many
    clients are waiting outside, and all of them will be back: the hint must cover them too."""
    ticks = _Ticks()
    admission = Admission(AdmissionPolicy(max_in_flight=10, max_in_flight_renewals=5), ticks)
    tickets = [admission.admit(renewal=False) for _ in range(10)]
    hints = []
    for _ in range(300):  # 3 s at a steady 100 completions/s
        ticks.now += 0.01
        tickets.pop(0).release()
        tickets.append(admission.admit(renewal=False))
        for _ in range(20):
            with pytest.raises(OverloadedError) as refused:
                admission.admit(renewal=False)
            hints.append(refused.value.retry_after_ms)
    assert hints[0] == 50  # nothing known yet: the floor
    assert hints[-1] >= 2_000, hints[-1]  # in flight alone would say 100 ms
    for ticket in tickets:
        ticket.release()


def test_clients_refused_before_the_first_window_closes_lengthen_the_hint():
    """A storm's first 0.4 s: 128 requests in flight completing at 500/s (the initial guess),
    five clients refused between two completions. No window has closed, so none of them is in
    the smoothed count of clients away yet; each must still be told to wait behind those
    refused before it, not the same floor-length wait that brings them all straight back
    (to be refused again, as often as the server can answer a refusal)."""
    ticks = _Ticks()
    admission = Admission(AdmissionPolicy(max_in_flight=128, max_in_flight_renewals=64), ticks)
    tickets = [admission.admit(renewal=False) for _ in range(128)]
    hints = []
    for _ in range(200):
        ticks.now += 0.002
        tickets.pop(0).release()
        tickets.append(admission.admit(renewal=False))
        for _ in range(5):
            with pytest.raises(OverloadedError) as refused:
                admission.admit(renewal=False)
            hints.append(refused.value.retry_after_ms)
    assert hints == sorted(hints)
    assert hints[0] == 256  # 128 in flight at 500/s
    assert 2_200 <= hints[-1] <= 2_300, hints[-1]  # and the 999 clients refused before it
    with pytest.raises(OverloadedError) as renewal:
        admission.admit(renewal=True)
    assert renewal.value.retry_after_ms >= 4 * hints[-1]
    for ticket in tickets:
        ticket.release()


def test_a_storm_is_spread_over_the_time_the_ca_needs_for_it():
    """A closed loop: 1,000 clients at once at a CA that takes 128 and completes 100 a second,
    so ~10 s of work. Each refused client comes back after its hint times U[1, 1.5] (meshca's
    agent) and is refused again if the CA is still full. Each is told its own turn (after
    the clients told before it), so no hint is beyond the time the whole queue takes and the
    CA is not left idle while clients stay away: everyone is served within ~15 s.

    With the clients away estimated from the refusal rate times the hints, the clients
    refused several times in the first second were counted several times over: every hint
    went to 30 s, clients came back together after the CA had drained, and the last one was
    served after 52 s (47 s with the current window's refusals counted too)."""
    ticks = _Ticks()
    admission = Admission(AdmissionPolicy(max_in_flight=128, max_in_flight_renewals=64), ticks)
    jitter = random.Random(7)
    arrivals = [(0.0, client) for client in range(1000)]
    inside: list[Any] = []  # tickets, completed in order every 10 ms
    next_completion, hints, served_by = 0.01, [], 0.0
    while arrivals or inside:
        if inside and (not arrivals or next_completion <= arrivals[0][0]):
            ticks.now = next_completion
            inside.pop(0).release()
            served_by, next_completion = ticks.now, ticks.now + 0.01
            continue
        ticks.now, client = heapq.heappop(arrivals)
        try:
            ticket = admission.admit(renewal=False)
        except OverloadedError as refused:
            hint = refused.retry_after_ms / 1000
            hints.append(hint)
            heapq.heappush(arrivals, (ticks.now + hint * jitter.uniform(1, 1.5), client))
            continue
        if not inside:
            next_completion = ticks.now + 0.01
        inside.append(ticket)
    assert max(hints) <= 11, max(hints)
    assert served_by <= 16, served_by
    assert len(hints) < 2_000, len(hints)


def test_only_an_explicit_renewal_header_marks_a_renewal():
    assert is_renewal([("authorization", "Bearer x"), ("x-meshca-renewal", "1")])
    assert is_renewal([("x-meshca-renewal", "true")])
    assert not is_renewal([])
    assert not is_renewal([("x-meshca-renewal", "0")])
    assert not is_renewal([("x-meshca-renewal", b"1")])


IDENTITY = SpiffeId("cluster.local", "default", "storm")


class _ReviewLikeAuthenticator:
    """Accepts every caller after a wait, as a TokenReview does under a busy API server: the
    situation where requests pile up inside the CA (while the CPU is free). Keeps the headers
    it saw, to check what clients send."""

    name = "slow-review"

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    async def authenticate(self, request: AuthnRequest) -> Caller:
        self.seen.append(dict(request.headers))
        await asyncio.sleep(0.2)
        return Caller(identity=IDENTITY, authenticator=self.name, subject="system:test")


def _serving(
    policy: AdmissionPolicy,
    authenticator: _ReviewLikeAuthenticator | None = None,
    tls_dir: Path | None = None,
) -> InProcessCa:
    """The real CertificateService on grpc.aio's server, served by `async with` on the test's
    loop (TLS when `tls_dir` is given: the agent's client insists on it; the root lands in
    `tls_dir/root-cert.pem`)."""
    ca = InProcessCa(
        tls_dir,
        authenticators=AuthenticatorChain([authenticator or _ReviewLikeAuthenticator()]),
        admission=Admission(policy, time.monotonic),
        tls=tls_dir is not None,
        rpc_server="aio",
    )
    if tls_dir is not None:
        (tls_dir / "root-cert.pem").write_bytes(ca.root_pem)
    return ca


async def _burst(addr: str, renewal: bool, count: int) -> list[object]:
    headers = [("x-meshca-renewal", "1")] if renewal else []
    request = ca_pb2.IstioCertificateRequest(csr=build_csr(generate_private_key(), IDENTITY))
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)

        async def one() -> object:
            try:
                return await stub.CreateCertificate(request, metadata=headers, timeout=20)
            except grpc.aio.AioRpcError as exc:
                return exc

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_a_real_server_sheds_excess_load_with_a_retry_hint_renewals_first():
    async def scenario() -> tuple[list[object], list[object], CaMetrics]:
        async with _serving(AdmissionPolicy(max_in_flight=20, max_in_flight_renewals=5)) as ca:
            first, renewals = await asyncio.gather(
                _burst(ca.addr, False, 60), _burst(ca.addr, True, 60)
            )
        return first, renewals, ca.metrics

    first, renewals, metrics = asyncio.run(scenario())
    refused = [r for r in first + renewals if isinstance(r, grpc.aio.AioRpcError)]
    assert refused, "120 requests at once must exceed a limit of 20"
    for error in refused:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "retry after the grpc-retry-pushback-ms hint" in (error.details() or "")
        hints = dict(error.trailing_metadata() or ())
        assert 50 <= int(hints[RETRY_PUSHBACK_TRAILER]) <= 10_000
    first_ok = sum(not isinstance(r, grpc.aio.AioRpcError) for r in first)
    renewals_ok = sum(not isinstance(r, grpc.aio.AioRpcError) for r in renewals)
    assert renewals_ok <= 5 < first_ok, (first_ok, renewals_ok)

    text = generate_latest(metrics.registry).decode()
    shed = sample_value(text, "meshca_ca_requests_shed_total")
    assert shed == len(refused)
    assert sample_value(text, "meshca_ca_certificates_issued_total") == 120 - len(refused)
    # Shed load is not a signing error on Istio's dashboards.
    assert sample_value(text, "citadel_server_csr_sign_err_count") == 0


def test_the_agent_client_honours_the_retry_hint_and_says_when_it_renews(tmp_path: Path):
    """Two agents ask at once of a CA that takes one request at a time: one is shed, waits the
    hinted time and gets its certificate; a renewal says so in its headers."""
    (tmp_path / "token").write_text("token-of-the-pod")
    authenticator = _ReviewLikeAuthenticator()

    async def scenario() -> tuple[CaMetrics, list[AgentMetrics]]:
        clock = SystemClock()
        agent_metrics = [AgentMetrics(clock), AgentMetrics(clock)]

        async def sign(client: CaClient, renewal: bool = False) -> None:
            key = generate_private_key()
            csr = build_csr(key, IDENTITY)
            await client.sign(
                SigningRequest(csr, IDENTITY, key, timedelta(hours=1), renewal=renewal)
            )

        async with _serving(
            AdmissionPolicy(max_in_flight=1, max_in_flight_renewals=1), authenticator, tmp_path
        ) as ca:
            clients = [
                CaClient(
                    f"localhost:{ca.port}",
                    tmp_path / "root-cert.pem",
                    FileTokenProvider(tmp_path / "token"),
                    clock,
                    metrics=m,
                    max_attempts=5,
                )
                for m in agent_metrics
            ]
            try:
                await asyncio.gather(*(sign(client) for client in clients))
                await sign(clients[0], renewal=True)
            finally:
                for client in clients:
                    await client.close()
        return ca.metrics, agent_metrics

    metrics, agent_metrics = asyncio.run(scenario())
    text = generate_latest(metrics.registry).decode()
    assert sample_value(text, "meshca_ca_requests_shed_total", {"kind": "first"}) >= 1
    assert sample_value(text, "meshca_ca_certificates_issued_total") == 3
    retries = sum(
        sample_value(generate_latest(m.registry).decode(), "num_outgoing_retries")
        for m in agent_metrics
    )
    assert retries >= 1
    # Only the last request (a renewal) says it is one.
    renewal_flags = [headers.get("x-meshca-renewal") for headers in authenticator.seen]
    assert renewal_flags[-1] == "1"
    assert renewal_flags[:-1] == [None] * (len(renewal_flags) - 1)
