"""Node mode's scheduler: one certificate per identity on the node, fetched by impersonation.

The node agent (ztunnel's pattern) authenticates to the CA as itself (its own service-account
token) and asks, with `ImpersonatedIdentity`, for each workload identity that has pods on its
node. `NodeSecretManager` keeps every such certificate fresh and publishes it to the
`SecretCache` under its SPIFFE ID (`spiffe://td/ns/NS/sa/SA`), plus `ROOTCA`.

Scheduling:

- `set_identities(snapshot)` (from an `agent.node_identities` source) reconciles: new identities
  are queued for their first certificate; identities no longer present stop rotating and their
  secret is removed from the cache (in-flight results for them are dropped).
- A `FetchQueue` orders pending work: an identity with no certificate yet always goes before any
  renewal (meshca: first certificates are what blocks a new pod; renewals have slack), FIFO
  within each class. An identity is queued at most once.
- `max_concurrent_fetches` worker tasks (default 8, like ztunnel) take from the queue, so never
  more than that many key generations + CSRs are in flight.
- Each fetch uses a fresh key (P-256 by default). Success schedules the renewal at the grace
  ratio with per-identity jitter (`rotation_delay`, `jittered_ratio` from
  `agent.secret_manager`). Failure keeps serving the cached certificate and retries that
  identity alone after a per-identity backoff (0.5 s doubling to 150 s, ztunnel's numbers,
  never past the cached certificate's expiry: `retry_delay`).

Concurrency model: asyncio, one event loop. `set_identities` runs on the loop (sources hop onto
it). Per identity there is at most one timer task (renewal or retry) and at most one worker
holding it. Key generation runs in a worker thread (`asyncio.to_thread`). Readers on the status
thread only call `has_valid_certificate`/`last_error`, which read snapshots (`dict` copies made
under the GIL); the worst case is a momentarily stale answer.

Readiness: ready once the identity source has reported at least once and every identity it
reports holds an unexpired certificate. A node with no workloads is ready; a newly scheduled pod
makes the agent not-ready until its identity's first certificate arrives (first in the queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from agent.backoff import Backoff
from agent.ca_client import SignedCertificate
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.secret_manager import (
    FailureRecord,
    jittered_ratio,
    new_key_and_csr,
    retry_delay,
    rotation_delay,
)
from agent.secrets import ROOT_RESOURCE, RootSecret, SecretCache, TlsSecret
from certs import (
    KeySpec,
    PrivateKey,
    SpiffeId,
    private_key_to_pem,
)
from meshca.clock import Clock

log = logging.getLogger(__name__)

NODE_BACKOFF = Backoff(initial=0.5, multiplier=2.0, maximum=150.0, jitter=0.5)
FIRST = 0  # priority classes: lower goes first
RENEWAL = 1


class ImpersonatingSigner(Protocol):
    """What the node manager needs from a CA client (`agent.ca_client.CaClient`, or a fake)."""

    async def sign(
        self,
        csr_pem: str,
        identity: SpiffeId,
        key: PrivateKey,
        ttl: timedelta,
        *,
        impersonate: SpiffeId | None = None,
    ) -> SignedCertificate: ...


class FetchQueue:
    """Identities waiting for a fetch: priority class first (`FIRST` before `RENEWAL`), then
    FIFO. Each identity is in the queue at most once; re-queuing with a better class promotes
    it. `discard` forgets one (lazily: its heap entry is skipped when it surfaces)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, SpiffeId]] = []
        self._queued: dict[SpiffeId, tuple[int, int]] = {}  # identity -> (class, seq) live
        self._seq = itertools.count()
        self._nonempty = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, identity: object) -> bool:
        return identity in self._queued

    def put(self, identity: SpiffeId, priority: int) -> None:
        held = self._queued.get(identity)
        if held is not None and held[0] <= priority:
            return
        entry = (priority, next(self._seq))
        self._queued[identity] = entry
        heapq.heappush(self._heap, (*entry, identity))
        self._nonempty.set()

    def discard(self, identity: SpiffeId) -> None:
        self._queued.pop(identity, None)

    def pop_nowait(self) -> SpiffeId | None:
        while self._heap:
            priority, seq, identity = heapq.heappop(self._heap)
            if self._queued.get(identity) == (priority, seq):
                del self._queued[identity]
                return identity
        return None

    async def get(self) -> SpiffeId:
        while True:
            identity = self.pop_nowait()
            if identity is not None:
                return identity
            self._nonempty.clear()
            await self._nonempty.wait()


@dataclass
class IdentityState:
    """Everything the manager knows about one identity. Replaced (not reused) if the identity
    leaves and comes back, so stale timers and fetches can tell by identity of the object."""

    identity: SpiffeId
    current: SignedCertificate | None = None
    failures: int = 0
    last_failure: FailureRecord | None = None
    next_rotation_at: datetime | None = None
    timer: asyncio.Task[None] | None = field(default=None, repr=False)
    rotations: int = 0

    def valid(self, now: datetime) -> bool:
        current = self.current
        return current is not None and current.leaf.not_valid_before_utc <= now < current.not_after

    def cancel_timer(self) -> None:
        if self.timer is not None and not self.timer.done():
            self.timer.cancel()
        self.timer = None


class NodeSecretManager:
    """Keeps one certificate per identity on the node; see the module docstring."""

    def __init__(
        self,
        config: AgentConfig,
        ca_client: ImpersonatingSigner,
        cache: SecretCache,
        clock: Clock,
        *,
        metrics: AgentMetrics | None = None,
        rng: random.Random | None = None,
        backoff: Backoff = NODE_BACKOFF,
    ) -> None:
        self._ttl = config.secret_ttl
        self._ratio = config.grace_period_ratio
        self._jitter = config.grace_period_ratio_jitter
        self._key_spec: KeySpec = config.key_spec
        self.max_concurrent = config.max_concurrent_fetches
        self._ca = ca_client
        self._cache = cache
        self._clock = clock
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._backoff = backoff
        self.queue = FetchQueue()
        self.states: dict[SpiffeId, IdentityState] = {}
        self.synced = False  # the identity source has reported at least once
        self.in_flight = 0
        self.max_in_flight = 0
        self._workers: list[asyncio.Task[None]] = []
        self._removals: set[asyncio.Task[None]] = set()

    # -- identities ------------------------------------------------------------------------

    def set_identities(self, identities: frozenset[SpiffeId]) -> None:
        """Reconciles with the source's snapshot (called on the event loop)."""
        self.synced = True
        for identity in sorted(identities, key=str):
            if identity not in self.states:
                log.info("identity %s appeared on the node; fetching its certificate", identity)
                self.states[identity] = IdentityState(identity)
                self._enqueue(identity, FIRST)
        for identity in [i for i in self.states if i not in identities]:
            self._forget(identity)
        self._update_gauges()

    def _forget(self, identity: SpiffeId) -> None:
        state = self.states.pop(identity)
        state.cancel_timer()
        self.queue.discard(identity)
        log.info("identity %s left the node; no longer rotating its certificate", identity)
        task = asyncio.get_running_loop().create_task(self._cache.remove(identity.uri))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    @property
    def identities(self) -> frozenset[SpiffeId]:
        return frozenset(self.states)

    # -- readiness (agent.status.ReadinessSource) ------------------------------------------

    def has_valid_certificate(self, now: datetime | None = None) -> bool:
        """Ready: the source has reported and every known identity holds a valid certificate."""
        if not self.synced:
            return False
        now = now or self._clock.now()
        return all(state.valid(now) for state in list(self.states.values()))

    @property
    def last_error(self) -> str | None:
        now = self._clock.now()
        states = list(self.states.values())
        missing = [s for s in states if not s.valid(now)]
        failed = [s for s in states if s.last_failure is not None]
        if not self.synced:
            return "the identity source has not reported the node's identities yet"
        if not missing and not failed:
            return None
        parts = []
        if missing:
            parts.append(f"{len(missing)} of {len(states)} identities have no valid certificate")
        if failed:
            latest = max(failed, key=lambda s: s.last_failure.at if s.last_failure else now)
            assert latest.last_failure is not None
            parts.append(
                f"{len(failed)} failing; latest: {latest.identity}: {latest.last_failure.message}"
            )
        return "; ".join(parts)

    # -- workers ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Runs the fetch workers until cancelled."""
        self._workers = [
            asyncio.create_task(self._worker(), name=f"node-fetch-{i}")
            for i in range(self.max_concurrent)
        ]
        try:
            await asyncio.gather(*self._workers)
        finally:
            for task in self._workers:
                task.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)
            self._workers = []

    async def _worker(self) -> None:
        while True:
            identity = await self.queue.get()
            state = self.states.get(identity)
            if state is None:
                continue
            self._update_gauges()
            try:
                await self._fetch_and_install(state)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not silently shrink the worker pool
                log.exception("unexpected error handling %s; retrying it later", identity)
                if self.states.get(identity) is state:
                    priority = RENEWAL if state.current else FIRST
                    self._schedule(state, self._backoff.maximum, priority)

    async def _fetch_and_install(self, state: IdentityState) -> None:
        identity = state.identity
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._update_gauges()
        try:
            key, csr = await asyncio.to_thread(new_key_and_csr, self._key_spec, identity)
            signed = await self._ca.sign(csr, identity, key, self._ttl, impersonate=identity)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self.states.get(identity) is state:
                self._on_failure(state, exc)
            return
        finally:
            self.in_flight -= 1
            self._update_gauges()
        if self.states.get(identity) is not state:
            log.debug("dropping the certificate for %s: it left the node meanwhile", identity)
            return
        await self._install(state, signed, private_key_to_pem(key).decode("ascii"))

    async def _install(self, state: IdentityState, signed: SignedCertificate, key: str) -> None:
        state.current = signed
        state.failures = 0
        state.last_failure = None
        state.rotations += 1
        ratio = jittered_ratio(self._ratio, self._jitter, self._rng)
        now = self._clock.now()
        delay = rotation_delay(signed.not_after, signed.received_at, now, ratio)
        state.next_rotation_at = now + timedelta(seconds=delay)
        # Root first: a peer may already present a leaf from a new root.
        await self._cache.publish(RootSecret(ROOT_RESOURCE, signed.root_bundle_pem))
        await self._cache.publish(TlsSecret(state.identity.uri, signed.chain_pem, key))
        if self._metrics:
            self._metrics.rotations.inc()
        log.info(
            "certificate serial %s for %s installed; expires %s, renewing in %.1fs",
            signed.serial_hex,
            state.identity,
            signed.not_after.isoformat(),
            delay,
        )
        self._schedule(state, delay, RENEWAL)

    def _on_failure(self, state: IdentityState, exc: Exception) -> None:
        message = str(exc) or type(exc).__name__
        state.failures += 1
        state.last_failure = FailureRecord(message, self._clock.now(), state.failures)
        if self._metrics:
            self._metrics.rotation_failures.inc()
        expires = state.current.not_after if state.current else None
        now = self._clock.now()
        delay = retry_delay(state.failures - 1, now, expires, self._rng, self._backoff)
        log.warning(
            "could not obtain a certificate for %s (attempt %d): %s; retrying in %.1fs%s",
            state.identity,
            state.failures,
            message,
            delay,
            "; still serving the cached certificate" if state.current else "",
        )
        self._schedule(state, delay, RENEWAL if state.current else FIRST)

    # -- timers ----------------------------------------------------------------------------

    def _schedule(self, state: IdentityState, delay: float, priority: int) -> None:
        state.cancel_timer()
        due_at = self._clock.now() + timedelta(seconds=delay)
        state.timer = asyncio.create_task(self._timer(state, due_at, priority))

    async def _timer(self, state: IdentityState, due_at: datetime, priority: int) -> None:
        await self._clock.sleep(max(0.0, (due_at - self._clock.now()).total_seconds()))
        if self.states.get(state.identity) is state:  # not forgotten meanwhile
            state.timer = None
            self._enqueue(state.identity, priority)

    def _enqueue(self, identity: SpiffeId, priority: int) -> None:
        self.queue.put(identity, priority)
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self._metrics is None:
            return
        self._metrics.node_identities.set(len(self.states))
        self._metrics.fetches_in_flight.set(self.in_flight)
        self._metrics.fetches_queued.set(len(self.queue))

    async def aclose(self) -> None:
        """Stops every timer (the `run()` task is cancelled by its owner)."""
        timers = [s.timer for s in self.states.values() if s.timer is not None]
        for state in self.states.values():
            state.cancel_timer()
        for timer in timers:
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        if self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)
