"""The scheduler in pod mode (one identity, published as `default`): rotation timing, the
stale-timer guard and retry backoff, on a FakeClock; and the pure rotation policy."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import grpc

from agent.ca_client import CaRequestError
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.rotation import jittered_ratio, retry_delay, rotation_delay
from agent.scheduler import CertificateScheduler
from agent.scheduler_state import IdentityState
from agent.secrets import RootSecret, SecretCache, TlsSecret
from certs import key_matches_certificate, load_cert, load_private_key
from meshca.clock import FakeClock
from tests.support.agent_scheduler import scheduler_for
from tests.support.agent_wiring import until
from tests.support.fake_ca import IDENTITY, FakeSigner
from tests.support.pki import TestCa

START = datetime(2030, 1, 1, tzinfo=UTC)
TTL = timedelta(seconds=100)


class RecordingClock(FakeClock):
    def __init__(self) -> None:
        super().__init__(START)
        self.sleeps: list[tuple[datetime, float]] = []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append((self.now(), seconds))
        await super().sleep(seconds)


def test_rotation_delay_is_measured_from_receipt_not_not_before() -> None:
    received = START
    not_after = received + TTL
    assert rotation_delay(not_after, received, received, 0.5) == 50.0
    assert rotation_delay(not_after, received, received + timedelta(seconds=10), 0.5) == 40.0
    assert rotation_delay(not_after, received, received, 0.2) == 80.0
    assert rotation_delay(not_after, received, not_after, 0.5) == 0.0  # overdue: now


def test_jittered_ratio_stays_within_bounds_and_varies() -> None:
    rng = random.Random(7)
    samples = [jittered_ratio(0.5, 0.01, rng) for _ in range(2000)]
    assert all(0.49 <= s <= 0.51 for s in samples)
    assert min(samples) < 0.495 and max(samples) > 0.505


def test_retry_delay_is_capped_and_never_past_expiry() -> None:
    rng = random.Random(1)
    delays = [retry_delay(n, START, None, rng) for n in range(40)]
    assert all(0 < d <= 30.0 for d in delays)
    assert delays[0] <= 0.5 and max(delays) > 15  # grows exponentially, then capped
    expires = START + timedelta(seconds=3)
    assert all(retry_delay(n, START, expires, rng) <= 3.0 for n in range(40))
    # Already expired: plain backoff, so an agent with no valid cert keeps trying.
    assert 0 < retry_delay(3, START + timedelta(seconds=5), expires, rng) <= 4.0


Harness = tuple[CertificateScheduler, FakeSigner, SecretCache, RecordingClock]


def only(scheduler: CertificateScheduler) -> IdentityState:
    """The pod agent's one identity."""
    return scheduler.states[IDENTITY]


@contextlib.asynccontextmanager
async def running_manager() -> AsyncIterator[Harness]:
    clock = RecordingClock()
    config = AgentConfig(
        namespace=IDENTITY.namespace, service_account=IDENTITY.service_account, secret_ttl=TTL
    )
    signer = FakeSigner(TestCa(START - timedelta(days=1)), clock)
    cache = SecretCache()
    metrics = AgentMetrics(clock)
    manager = scheduler_for(config, signer, cache, clock, metrics, rng=random.Random(3))
    task = asyncio.create_task(manager.run())
    manager.set_identities(frozenset({IDENTITY}))
    try:
        yield manager, signer, cache, clock
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await manager.aclose()


def run(scenario: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        async with running_manager() as harness:
            await scenario(harness)

    asyncio.run(main())


def test_first_certificate_is_published_and_rotated() -> None:
    run(_test_first_certificate_is_published_and_rotated)


async def _test_first_certificate_is_published_and_rotated(h: Harness) -> None:
    manager, signer, cache, clock = h
    await until(lambda: only(manager).generation == 1)
    tls = cache.get("default")
    root = cache.get("ROOTCA")
    assert isinstance(tls, TlsSecret) and isinstance(root, RootSecret)
    assert key_matches_certificate(
        load_private_key(tls.private_key_pem), load_cert(tls.cert_chain_pem)
    )
    assert manager.has_valid_certificate(clock.now())
    first_version = tls.version
    due_at = only(manager).next_rotation_at
    assert due_at is not None
    due = (due_at - clock.now()).total_seconds()
    assert 49.0 <= due <= 51.0

    clock.advance(due - 1)
    await asyncio.sleep(0.05)
    assert len(signer.calls) == 1  # not yet
    clock.advance(1.01)
    await until(lambda: only(manager).generation == 2)
    rotated = cache.get("default")
    assert rotated is not None and rotated.version != first_version
    assert len(signer.calls) == 2
    assert signer.impersonated == [None, None]  # the pod agent asks for itself
    # The rotation holds a valid certificate: a renewal, which an overloaded CA may shed first.
    assert signer.renewals == [False, True]


def test_stale_timer_does_not_fire_after_newer_certificate() -> None:
    run(_test_stale_timer_does_not_fire_after_newer_certificate)


async def _test_stale_timer_does_not_fire_after_newer_certificate(h: Harness) -> None:
    manager, signer, _cache, clock = h
    await until(lambda: only(manager).generation == 1)
    # A timer for generation 1 that escaped cancellation (raced with it) ...
    state = only(manager)
    stale = asyncio.create_task(manager._timer(state, 1, clock.now() + timedelta(seconds=10), 1))
    await asyncio.sleep(0)
    manager.request_rotation()  # ... then a newer certificate arrives early.
    await until(lambda: only(manager).generation == 2)
    clock.advance(10.0)
    await stale
    await asyncio.sleep(0.05)
    assert len(signer.calls) == 2, "the generation-1 timer must not trigger another renewal"
    manager._on_due(state, 1, 1)
    await asyncio.sleep(0.05)
    assert len(signer.calls) == 2


def test_ca_failure_keeps_cached_cert_and_backs_off_within_expiry() -> None:
    run(_test_ca_failure_keeps_cached_cert_and_backs_off_within_expiry)


async def _test_ca_failure_keeps_cached_cert_and_backs_off_within_expiry(h: Harness) -> None:
    manager, signer, cache, clock = h
    await until(lambda: only(manager).generation == 1)
    served = cache.get("default")
    current = only(manager).current
    assert current is not None
    expires = current.not_after
    signer.fail_always = CaRequestError(grpc.StatusCode.UNAVAILABLE, "CA is down")
    clock.sleeps.clear()
    # Walk time to just before expiry in 1 s steps, letting the manager react each step.
    while clock.now() < expires - timedelta(seconds=1):
        clock.advance(1.0)
        await asyncio.sleep(0.002)
        assert cache.get("default") is served
        assert manager.has_valid_certificate(clock.now())
    retries = [(at, d) for at, d in clock.sleeps if d < 40]  # the rotation timer slept ~50 s
    assert len(retries) >= 5
    for at, delay in retries:
        assert delay <= 30.0
        assert at + timedelta(seconds=delay) <= expires
    assert manager.last_error == "CA returned UNAVAILABLE: CA is down"

    signer.fail_always = None
    clock.advance(31.0)
    await until(lambda: only(manager).generation == 2)
    assert manager.last_error is None
    assert cache.get("default") is not served
