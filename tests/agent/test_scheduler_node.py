"""The scheduler in node mode (many identities, by impersonation) on a FakeClock: the priority
queue (first certificates before renewals),
bounded concurrency, per-identity backoff, serving the cached certificate while the CA fails,
and forgetting identities that leave the node."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.scheduler import CertificateScheduler
from agent.scheduler_state import FIRST, RENEWAL, FetchQueue
from agent.secrets import ROOT_RESOURCE, SecretCache, TlsSecret
from certs import SpiffeId
from meshca.clock import FakeClock
from tests.support.agent_scheduler import scheduler_for
from tests.support.agent_wiring import until
from tests.support.fake_ca import FakeSigner
from tests.support.pki import TestCa

START = datetime(2030, 1, 1, tzinfo=UTC)
TTL = timedelta(seconds=100)


def sid(name: str) -> SpiffeId:
    return SpiffeId("cluster.local", "ns", name)


A, B, C, D, F = (sid(n) for n in ("a", "b", "c", "d", "f"))


@contextlib.asynccontextmanager
async def running(
    max_fetches: int = 8,
) -> AsyncIterator[tuple[CertificateScheduler, FakeSigner, SecretCache, FakeClock]]:
    clock = FakeClock(START)
    signer = FakeSigner(TestCa(START), clock)
    cache = SecretCache()
    config = AgentConfig(
        secret_ttl=TTL,
        max_concurrent_fetches=max_fetches,
        node_mode=True,
        identities=(("ns", "static"),),
    )
    metrics = AgentMetrics(clock)
    manager = scheduler_for(config, signer, cache, clock, metrics, rng=random.Random(7))
    task = asyncio.create_task(manager.run())
    try:
        yield manager, signer, cache, clock
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await manager.aclose()


def test_fetch_queue_orders_first_certificates_before_renewals() -> None:
    async def main() -> None:
        queue = FetchQueue()
        queue.put(A, RENEWAL)
        queue.put(B, RENEWAL)
        queue.put(C, FIRST)
        queue.put(A, RENEWAL)  # already queued: no duplicate
        queue.put(D, FIRST)
        queue.put(B, FIRST)  # promoted
        queue.discard(D)
        assert len(queue) == 3 and D not in queue
        assert [await queue.get() for _ in range(3)] == [C, B, A]
        assert queue.pop_nowait() is None

    asyncio.run(main())


def test_first_certificates_go_before_pending_renewals() -> None:
    async def main() -> None:
        async with running(max_fetches=1) as (manager, signer, _cache, clock):
            manager.set_identities(frozenset({A, B}))
            await until(lambda: all(s.current for s in manager.states.values()))
            assert signer.identities == [A, B]
            assert signer.impersonated == [A, B]  # each CSR asks for the pod identity

            signer.gate.clear()
            clock.advance(60)  # past both rotation points (50 s ± 1 %)
            await until(lambda: len(signer.calls) == 3 and len(manager.queue) == 1)
            assert signer.identities[2] == A  # the only worker is busy renewing A; B waits
            manager.set_identities(frozenset({A, B, C, D}))  # two new pods' identities
            assert len(manager.queue) == 3
            signer.gate.set()
            await until(lambda: len(signer.calls) == 6)
            assert signer.identities[3:] == [C, D, B]  # first certificates overtook B's renewal
            await until(lambda: manager.has_valid_certificate())

    asyncio.run(main())


def test_concurrency_is_bounded_by_the_worker_count() -> None:
    async def main() -> None:
        async with running(max_fetches=3) as (manager, signer, _cache, _clock):
            signer.gate.clear()
            identities = frozenset(sid(f"w{i}") for i in range(20))
            manager.set_identities(identities)
            await until(lambda: len(signer.calls) == 3)
            await asyncio.sleep(0.05)
            assert len(signer.calls) == 3 and manager.in_flight == 3
            signer.gate.set()
            await until(lambda: manager.has_valid_certificate())
            assert manager.max_in_flight == 3
            assert sorted(signer.identities, key=str) == sorted(identities, key=str)

    asyncio.run(main())


def test_failing_identity_backs_off_alone_and_cached_certs_keep_serving() -> None:
    async def main() -> None:
        async with running() as (manager, signer, cache, clock):
            signer.failing = {F}
            manager.set_identities(frozenset({A, F}))
            await until(lambda: manager.states[A].current is not None)
            await until(lambda: manager.states[F].failures == 1)
            assert not manager.has_valid_certificate()
            assert "sa/f" in (manager.last_error or "") and "CA down" in (manager.last_error or "")
            for attempt in range(2, 5):  # 0.5 s doubling, jittered: ≤ 0.5, 1, 2 s
                clock.advance(2**attempt)
                await until(lambda n=attempt: manager.states[F].failures == n)  # type: ignore[misc]
            assert signer.identities.count(A) == 1  # A was not retried along with F
            signer.failing = set()
            clock.advance(10)
            await until(lambda: manager.has_valid_certificate())

            # The CA refuses A's renewal: its cached certificate keeps being served.
            before = cache.get(A.uri)
            signer.failing = {A}
            clock.advance(52)
            await until(lambda: manager.states[A].failures >= 1)
            assert cache.get(A.uri) is before
            assert manager.has_valid_certificate()  # still unexpired
            signer.failing = set()
            clock.advance(30)
            await until(lambda: cache.get(A.uri) is not before)
            assert manager.states[A].failures == 0

    asyncio.run(main())


def test_identity_leaving_the_node_stops_rotation_and_removes_its_secret() -> None:
    async def main() -> None:
        async with running() as (manager, signer, cache, clock):
            manager.set_identities(frozenset({A, B}))
            await until(lambda: manager.has_valid_certificate())
            assert isinstance(cache.get(B.uri), TlsSecret) and cache.get(ROOT_RESOURCE)
            manager.set_identities(frozenset({A}))
            await until(lambda: cache.get(B.uri) is None)
            assert B not in manager.states
            for _ in range(4):  # several rotation periods: only A renews
                clock.advance(60)
                await asyncio.sleep(0.05)
            await until(lambda: signer.identities.count(A) >= 3)
            assert signer.identities.count(B) == 1
            manager.set_identities(frozenset({A, B}))  # a pod of B is scheduled again
            await until(lambda: cache.get(B.uri) is not None)
            assert signer.identities.count(B) == 2

    asyncio.run(main())


def test_readiness_waits_for_the_source_and_an_empty_node_is_ready() -> None:
    async def main() -> None:
        async with running() as (manager, _signer, _cache, _clock):
            assert not manager.has_valid_certificate()
            assert "has not reported" in (manager.last_error or "")
            manager.set_identities(frozenset())
            assert manager.has_valid_certificate() and manager.last_error is None

    asyncio.run(main())
