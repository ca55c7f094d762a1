"""Keeps the workload's certificate fresh: generate a key, ask the CA, publish, rotate, repeat.

Concurrency model (asyncio, one event loop):

- `run()` is the single worker. It waits for a "rotation due" wake-up, then obtains a
  certificate, retrying until it succeeds. Only the worker talks to the CA, so there is never
  more than one request in flight per agent.
- After each new certificate, one timer task sleeps (on the injected `Clock`) until the rotation
  point and then wakes the worker. Every certificate gets a generation number; a timer carries
  the generation it was scheduled for and does nothing if a newer certificate has arrived since
  (the stale-timer guard), even if cancellation raced with it firing.
- Key generation (RSA can take ~100 ms) runs in a worker thread so the loop keeps serving SDS.
- Readers on other threads (the status server) only read immutable snapshots
  (`current`, `last_error`) that are replaced by a single assignment.

Rotation point: `expire - ratio * (expire - received) `, ratio = 0.5 ± U·jitter (REFERENCE §4),
measured from when the certificate was received rather than from its NotBefore, which the CA
backdates by two minutes for clock skew. On failure the cached certificate keeps being served
and the attempt is retried with exponential backoff and jitter, capped at 30 s and never
scheduled past the current certificate's expiry.

Restart: with `restore_from` (the agent's `--output-dir`), `run()` first tries to adopt the
certificate a previous run left there (`agent.cert_state`): if it passes the checks it is
published at once, without a CA call, and its rotation is scheduled as if it had been received
when the CA issued it (NotBefore + the two-minute backdate). So an agent restarted while the CA
is down is ready immediately and renews, with the usual backoff, once the CA is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

from agent.backoff import Backoff
from agent.ca_client import SignedCertificate
from agent.cert_state import (
    CertificateNotRestored,
    NoPreviousCertificate,
    load_previous_certificate,
)
from agent.config import AgentConfig, ConfigError
from agent.metrics import AgentMetrics
from agent.secrets import DEFAULT_RESOURCE, ROOT_RESOURCE, RootSecret, SecretCache, TlsSecret
from agent.token import TokenError
from certs import (
    KeySpec,
    PrivateKey,
    SpiffeId,
    build_csr,
    describe_certificate,
    generate_private_key,
    private_key_to_pem,
)
from meshca.clock import Clock

log = logging.getLogger(__name__)

RENEWAL_BACKOFF = Backoff(initial=0.5, multiplier=2.0, maximum=30.0, jitter=0.5)


class CertificateSigner(Protocol):
    """What the manager needs from a CA client (`agent.ca_client.CaClient`, or a test fake)."""

    async def sign(
        self, csr_pem: str, identity: SpiffeId, key: PrivateKey, ttl: timedelta
    ) -> SignedCertificate: ...


@dataclass(frozen=True)
class FailureRecord:
    """The last failed attempt, for the status endpoint and logs."""

    message: str
    at: datetime
    consecutive: int


def rotation_delay(
    not_after: datetime, received_at: datetime, now: datetime, ratio: float
) -> float:
    """Seconds from `now` until `ratio` of the lifetime (counted from `received_at`) remains.

    Never negative: a certificate already past its rotation point is renewed at once.
    """
    lifetime = not_after - received_at
    rotate_at = not_after - lifetime * ratio
    return max(0.0, (rotate_at - now).total_seconds())


def jittered_ratio(ratio: float, jitter: float, rng: random.Random) -> float:
    """`ratio ± U·jitter`: spreads renewals of agents that started together (no herd)."""
    return ratio + rng.uniform(-jitter, jitter)


def retry_delay(
    attempt: int,
    now: datetime,
    expires: datetime | None,
    rng: random.Random,
    backoff: Backoff = RENEWAL_BACKOFF,
) -> float:
    """Backoff before retry `attempt`, but never past `expires` while the certificate is valid,
    so the last retry happens before the workload's certificate runs out."""
    delay = backoff.delay(attempt, rng)
    if expires is not None and now < expires:
        delay = min(delay, (expires - now).total_seconds())
    return delay


class SecretManager:
    """Obtains the workload certificate and publishes `default` and `ROOTCA` to the cache."""

    def __init__(
        self,
        config: AgentConfig,
        ca_client: CertificateSigner,
        cache: SecretCache,
        clock: Clock,
        *,
        identity: Callable[[], SpiffeId] | None = None,
        metrics: AgentMetrics | None = None,
        rng: random.Random | None = None,
        backoff: Backoff = RENEWAL_BACKOFF,
        restore_from: Path | None = None,
    ) -> None:
        self._ttl = config.secret_ttl
        self._ratio = config.grace_period_ratio
        self._jitter = config.grace_period_ratio_jitter
        self._key_spec: KeySpec = config.key_spec
        self._identity = identity or _fixed_identity(config)
        self._ca = ca_client
        self._cache = cache
        self._clock = clock
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._backoff = backoff
        self._restore_from = restore_from
        self._wake = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None
        self.generation = 0
        self.current: SignedCertificate | None = None
        self.last_failure: FailureRecord | None = None
        self.next_rotation_at: datetime | None = None
        self.restored = False  # the current certificate came from a previous run's files

    # -- state for readiness and status ---------------------------------------------------

    def has_valid_certificate(self, now: datetime | None = None) -> bool:
        """True while a certificate is held and unexpired (the readiness condition)."""
        current = self.current
        if current is None:
            return False
        now = now or self._clock.now()
        return current.leaf.not_valid_before_utc <= now < current.not_after

    @property
    def last_error(self) -> str | None:
        """The message of the most recent failed attempt, cleared by the next success."""
        failure = self.last_failure
        return failure.message if failure else None

    # -- control --------------------------------------------------------------------------

    def request_rotation(self) -> None:
        """Renews now (e.g. an operator signal); harmless if a renewal is already running."""
        self._wake.set()

    async def run(self) -> None:
        """The worker: restore the previous run's certificate or obtain one now, then renew
        whenever rotation is due. Runs until cancelled."""
        try:
            if not await self._restore_previous():
                self._wake.set()
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self._obtain_until_success()
        finally:
            self._cancel_timer()

    # -- internals ------------------------------------------------------------------------

    async def _restore_previous(self) -> bool:
        """Adopts the certificate in `restore_from` if `agent.cert_state` accepts it; logs one
        line saying what happened either way. True if a certificate was installed."""
        directory = self._restore_from
        if directory is None:
            return False
        try:
            identity = self._identity()
        except (TokenError, ConfigError) as exc:
            log.info(
                "not restoring certificate files from %s: identity not known yet (%s)",
                directory,
                exc,
            )
            return False
        now = self._clock.now()
        try:
            previous = await asyncio.to_thread(load_previous_certificate, directory, identity, now)
        except NoPreviousCertificate:
            log.info("no certificate from a previous run in %s; asking the CA", directory)
            return False
        except CertificateNotRestored as exc:
            log.warning(
                "not restoring the certificate files in %s: %s; asking the CA for a new one",
                directory,
                exc,
            )
            return False
        except Exception:  # a bug in the checks must not stop the agent from asking the CA
            log.exception("could not check the certificate files in %s; asking the CA", directory)
            return False
        await self._install(previous.signed, previous.key_pem, restored_from=previous.source)
        return True

    async def _obtain_until_success(self) -> None:
        attempt = 0
        while True:
            try:
                signed, key_pem = await self._fetch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._record_failure(exc, attempt + 1)
                expires = self.current.not_after if self.current else None
                delay = retry_delay(attempt, self._clock.now(), expires, self._rng, self._backoff)
                attempt += 1
                log.warning(
                    "could not obtain a certificate (attempt %d): %s; retrying in %.1fs%s",
                    attempt,
                    exc,
                    delay,
                    "; still serving the cached certificate" if self.current else "",
                )
                await self._clock.sleep(delay)
                continue
            await self._install(signed, key_pem)
            return

    async def _fetch(self) -> tuple[SignedCertificate, str]:
        """A fresh key (never reused across rotations) and the CA's certificate for it."""
        identity = self._identity()
        key, csr = await asyncio.to_thread(new_key_and_csr, self._key_spec, identity)
        signed = await self._ca.sign(csr, identity, key, self._ttl)
        return signed, private_key_to_pem(key).decode("ascii")

    async def _install(
        self, signed: SignedCertificate, key_pem: str, *, restored_from: Path | None = None
    ) -> None:
        """Publishes a certificate (from the CA, or `restored_from` a previous run's files) and
        schedules its rotation."""
        self.current = signed
        self.restored = restored_from is not None
        self.generation += 1
        self.last_failure = None
        ratio = jittered_ratio(self._ratio, self._jitter, self._rng)
        now = self._clock.now()
        delay = rotation_delay(signed.not_after, signed.received_at, now, ratio)
        self.next_rotation_at = now + timedelta(seconds=delay)
        # Root first: a peer of ours may already present a leaf from a new root.
        await self._cache.publish(RootSecret(ROOT_RESOURCE, signed.root_bundle_pem))
        await self._cache.publish(TlsSecret(DEFAULT_RESOURCE, signed.chain_pem, key_pem))
        if self._metrics:
            counter = self._metrics.restores if restored_from else self._metrics.rotations
            counter.inc()
        log.info(
            "certificate serial %s for %s %s; expires %s, rotating in %.1fs",
            signed.serial_hex,
            ", ".join(describe_certificate(signed.leaf).uri_sans),
            f"restored from {restored_from} (previous run)" if restored_from else "installed",
            signed.not_after.isoformat(),
            delay,
        )
        self._schedule_rotation(self.generation, self.next_rotation_at)

    def _schedule_rotation(self, generation: int, due_at: datetime) -> None:
        self._cancel_timer()
        self._timer = asyncio.create_task(self._rotation_timer(generation, due_at))

    async def _rotation_timer(self, generation: int, due_at: datetime) -> None:
        # An absolute deadline: time spent before this task first runs is not added on top.
        await self._clock.sleep(max(0.0, (due_at - self._clock.now()).total_seconds()))
        self._on_rotation_due(generation)

    def _on_rotation_due(self, generation: int) -> None:
        """Timer callback: rotate only if the certificate it was set for is still current."""
        if generation != self.generation:
            log.debug("stale rotation timer (generation %d, now %d)", generation, self.generation)
            return
        self._wake.set()

    def _cancel_timer(self) -> None:
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()
        self._timer = None

    def _record_failure(self, exc: Exception, consecutive: int) -> None:
        message = str(exc) or type(exc).__name__
        self.last_failure = FailureRecord(message, self._clock.now(), consecutive)
        if self._metrics:
            self._metrics.rotation_failures.inc()

    async def aclose(self) -> None:
        """Stops the rotation timer (the `run()` task is cancelled by its owner)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer


def new_key_and_csr(spec: KeySpec, identity: SpiffeId) -> tuple[PrivateKey, str]:
    """A fresh private key (never reused across rotations) and a CSR for `identity`; CPU-bound,
    so callers run it in a worker thread."""
    key = generate_private_key(spec)
    return key, build_csr(key, identity)


def _fixed_identity(config: AgentConfig) -> Callable[[], SpiffeId]:
    def identity() -> SpiffeId:
        if config.identity is None:
            raise ConfigError(
                "no identity configured: set POD_NAMESPACE and SERVICE_ACCOUNT "
                "(or let the agent read them from the token)"
            )
        return config.identity

    return identity
