"""Issue #9 forced rotation, the agent's half: leaves signed by an authority the CA has tainted
are re-signed at a uniform point of the taint window (`agent.rotation`), decided once in the one
scheduler for a pod's one identity and a node's many; on a FakeClock, with a fake signer."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.propagation import leaf_authority
from agent.rotation import RotationPolicy
from agent.scheduler import CertificateScheduler
from agent.secrets import SecretCache
from agent.taints import MAX_TAINT_AGE, SOURCE_REPORT, taints_from_report
from ca_server.authority.slots import authority_id
from certs import SpiffeId
from meshca.clock import FakeClock
from tests.support.agent_scheduler import scheduler_for
from tests.support.agent_wiring import advance_settled, until
from tests.support.fake_ca import FakeSigner
from tests.support.pki import TestCa

START = datetime(2030, 1, 1, tzinfo=UTC)
TTL = timedelta(seconds=1000)  # renewal at ~500 s: far beyond the taint window
WINDOW = timedelta(seconds=60)
IDENTITIES = frozenset(SpiffeId("cluster.local", "ns", f"sa{n}") for n in range(40))


def report_taint(
    scheduler: CertificateScheduler, clock: FakeClock, seconds_since: dict[str, float]
) -> int:
    """What the periodic report's answer does with its taints (`agent.reporter`)."""
    return scheduler.taints_learned(taints_from_report(seconds_since, clock.now()), SOURCE_REPORT)


@contextlib.asynccontextmanager
async def node_scheduler() -> AsyncIterator[
    tuple[CertificateScheduler, FakeSigner, FakeClock, AgentMetrics]
]:
    clock = FakeClock(START)
    signer = FakeSigner(TestCa(START), clock)
    config = AgentConfig(
        secret_ttl=TTL,
        node_mode=True,
        identities=(("ns", "static"),),
        taint_resign_window=WINDOW,
    )
    metrics, cache = AgentMetrics(clock), SecretCache()
    scheduler = scheduler_for(config, signer, cache, clock, metrics, rng=random.Random(11))
    task = asyncio.create_task(scheduler.run())
    try:
        yield scheduler, signer, clock, metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await scheduler.aclose()


def test_taint_delay_is_uniform_over_the_window_counted_from_the_taint() -> None:
    policy = RotationPolicy(ttl=TTL, taint_resign_window=timedelta(seconds=100))
    rng = random.Random(3)
    fresh = [policy.taint_resign_delay(0.0, rng) for _ in range(4000)]
    assert all(0.0 <= d <= 100.0 for d in fresh)
    assert 45 < statistics.mean(fresh) < 55
    # Ten buckets of 10 s each hold about a tenth: no pile-up anywhere in the window.
    counts = [sum(1 for d in fresh if b * 10 <= d < (b + 1) * 10) for b in range(10)]
    assert min(counts) > 300 and max(counts) < 500, counts
    # Heard of it 40 s late: the rest of the window, or at once for points already past.
    late = [policy.taint_resign_delay(40.0, rng) for _ in range(4000)]
    assert all(0.0 <= d <= 60.0 for d in late)
    assert 0.3 < sum(1 for d in late if d == 0.0) / len(late) < 0.5
    assert policy.taint_resign_delay(500.0, rng) == 0.0  # window long over: now


def test_tainted_leaves_are_resigned_spread_over_the_window_once() -> None:
    async def main() -> None:
        async with node_scheduler() as (scheduler, signer, clock, metrics):
            scheduler.set_identities(IDENTITIES)
            await until(lambda: scheduler.installs == len(IDENTITIES))
            old = authority_id(signer.pki.cert)
            assert scheduler.leaf_authorities() == {old}

            assert report_taint(scheduler, clock, {"ab" * 20: 0.0}) == 0  # not ours
            signer.pki = TestCa(START)  # the CA activated a new authority
            new = authority_id(signer.pki.cert)
            assert report_taint(scheduler, clock, {old: 0.0}) == len(IDENTITIES)
            assert report_taint(scheduler, clock, {old: 5.0}) == 0  # repeated: once only
            assert metrics.taint_resigns._value.get() == len(IDENTITIES)
            drawn = {
                s.identity: (s.due_at - START).total_seconds()
                for s in scheduler.states.values()
                if s.due_at is not None
            }
            assert len(drawn) == len(IDENTITIES)
            due = sorted(drawn.values())
            assert due[0] >= 0 and due[-1] <= WINDOW.total_seconds()
            assert due[-1] - due[0] > WINDOW.total_seconds() / 2  # spread, not one instant

            # Fake time moves in 1 s steps, each one finished before the next (the signer sees
            # the fake time it fell due, however slowly the key-generation thread runs).
            before = len(signer.calls)
            await advance_settled(clock, scheduler, WINDOW.total_seconds())
            resigned = signer.calls[before:]
            assert Counter(call.identity for call in resigned) == Counter(IDENTITIES)
            at = {call.identity: (call.at - START).total_seconds() for call in resigned}
            # Each at its own drawn point: the first whole second of fake time at or after it.
            assert at == {identity: math.ceil(d) for identity, d in drawn.items()}
            assert scheduler.leaf_authorities() == {new}
            # Ten-second buckets (a point at 10 s is signed at 10 s: the first bucket's).
            per_10s = Counter(max(0, math.ceil(t / 10) - 1) for t in at.values())
            counts = [per_10s[b] for b in range(int(WINDOW.total_seconds()) // 10)]
            assert sum(counts) == len(IDENTITIES), counts  # all within the window
            assert min(counts) > 0, counts  # over the whole window, not bunched in part of it
            assert max(counts) <= len(IDENTITIES) / 2, counts  # never half of them at once
            # Re-signed once: another window later, nobody has asked again.
            await advance_settled(clock, scheduler, WINDOW.total_seconds())
            assert len(signer.calls) == before + len(IDENTITIES)
            # The new leaves are not tainted: nothing more moves.
            assert report_taint(scheduler, clock, {old: 70.0}) == 0
            assert all(
                leaf_authority(s.current.leaf) == new
                for s in scheduler.states.values()
                if s.current
            )

    asyncio.run(main())


def test_a_renewal_already_due_sooner_is_not_postponed() -> None:
    async def main() -> None:
        async with node_scheduler() as (scheduler, signer, clock, _metrics):
            only = frozenset(list(IDENTITIES)[:1])
            scheduler.set_identities(only)
            await until(lambda: scheduler.installs == 1)
            state = next(iter(scheduler.states.values()))
            clock.advance(TTL.total_seconds() / 2 - 5)  # its renewal is ~5 s away
            due = state.due_at
            assert due is not None
            tainted = {authority_id(signer.pki.cert): 0.0}
            # A 60 s window would draw a point later than 5 s in most draws; it keeps the sooner.
            report_taint(scheduler, clock, tainted)
            assert state.due_at is not None and state.due_at <= due

    asyncio.run(main())


@pytest.mark.parametrize("since", [1e300, float("inf"), float("nan"), -float("inf"), -5.0])
def test_a_report_age_no_clock_can_hold_is_clamped_not_raised(since: float):
    """A broken or hostile CA's answer (an age past any datetime, infinite, not a number, or
    negative) counts as the oldest age the agent keeps, or as now: before, an age past
    `datetime.min` raised in the reporter at every period."""
    now = datetime(2030, 1, 1, tzinfo=UTC)
    (at,) = taints_from_report({"ab": since}, now).values()
    assert at == (now if since < 0 else now - MAX_TAINT_AGE)
