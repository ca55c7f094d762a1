"""The one certificate scheduler: keeps a certificate fresh for every identity in a set.

The shape of SPIRE's agent manager and ztunnel's SecretManager: an identity source reports the
set of identities to serve; a pure policy (`agent.rotation`) decides when each is due; this
module's driver acts. The pod agent and the node agent are the same scheduler fed differently:

- pod agent: a `SingleIdentitySource` (`agent.identity_sources`) reports the one identity
  (configured, or read from the token) and `resource_name` publishes it as `default`; the CA is
  asked for it directly;
- node agent: a node source (`agent.node_identities`: pods on the node, or a static list)
  reports many; each is published under its SPIFFE ID and asked for by impersonation
  (`impersonate=True`, the node agent authenticates as itself).

Per identity, in order: the start hook (restore a previous run's certificate, see
`agent.file_output.FileOutput.restore`), else key + CSR → `signer.sign` → publish root, then
leaf → schedule the renewal at the jittered grace ratio. The root is not published as is: the
answer's bundle is one source of the served `ROOTCA` (`agent.trust_bundle`'s keeper), and a
bundle change never makes the scheduler ask for a leaf. A failure
keeps serving the cached certificate and retries that identity alone with backoff, never past
its expiry.

Scheduling:

- `set_identities(snapshot)` reconciles: new identities are queued for their first certificate;
  identities no longer present stop rotating and their secret is removed from the cache
  (in-flight results for them are dropped).
- `taints_learned(...)` (from the periodic report's answer, `agent.reporter`, and from the
  taint notice beside the root file, `agent.taint_file`; merged in `agent.taints`) moves the
  renewal of every identity whose leaf a tainted authority signed to its own point of the
  taint window (`agent.rotation`): one rule for the pod agent's one identity and a node's
  many, and for a certificate installed later (restored from a previous run) too. At most
  one such early re-sign per identity per taint (`agent.taints`, rule 5): a CA that answers it
  with a leaf of the same authority again gets no second one; that leaf rotates as usual.
- A `FetchQueue` (`agent.scheduler_state`, with each identity's `IdentityState`) orders
  pending work: an identity with no certificate yet always goes before any renewal (first
  certificates are what blocks a new pod; renewals have slack), FIFO within each class. An
  identity is queued at most once.
- `max_concurrent` worker tasks take from the queue, so never more than that many key
  generations + CA calls are in flight (the node agent keeps 8, like ztunnel).
- Timers carry the generation (count of installed certificates) of the identity they were set
  for and do nothing if a newer certificate arrived since: the stale-timer guard, even if
  cancellation raced with the timer firing.

Concurrency model: asyncio, one event loop. `set_identities` runs on the loop (sources hop onto
it). Per identity there is at most one timer task and at most one worker holding it. Key
generation and the start hook's file reads run in worker threads (`asyncio.to_thread`). Readers
on the status thread only call `has_valid_certificate`/`last_error`, which read snapshots
(`list` copies made under the GIL); the worst case is a momentarily stale answer.

Readiness: ready once the source has reported and every identity it reports holds an unexpired
certificate. A node with no workloads is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from pathlib import Path

from agent.cert_state import RestoredCertificate
from agent.config import AgentConfig
from agent.errors import CertificateNotRestored, NoPreviousCertificate
from agent.identity_source import IdentitySet
from agent.metrics import AgentMetrics
from agent.propagation import leaf_authority
from agent.rotation import (
    NODE_BACKOFF,
    SINGLE_IDENTITY_BACKOFF,
    FailureRecord,
    RotationPolicy,
    new_key_and_csr,
)
from agent.scheduler_state import FIRST, RENEWAL, FetchQueue, IdentityState
from agent.secrets import DEFAULT_RESOURCE, SecretCache, TlsSecret
from agent.signing import CertificateSigner, SignedCertificate, SigningRequest
from agent.taints import KnownTaints
from agent.trust_bundle import SOURCE_CA_RESPONSE, SOURCE_RESTORED, TrustBundleKeeper
from certs import KeySpec, SpiffeId, describe_certificate, private_key_to_pem
from meshca.clock import Clock

log = logging.getLogger(__name__)

StartHook = Callable[[SpiffeId, str, datetime], RestoredCertificate]
"""`(identity, resource name, now)` -> a previous run's certificate, or raises
`CertificateNotRestored`; blocking (run in a thread). `FileOutput.restore` is the one in use."""


def publish_as_default(identity: SpiffeId) -> str:
    """The pod agent's naming: its one certificate is the SDS resource `default`."""
    return DEFAULT_RESOURCE


def publish_as_spiffe_id(identity: SpiffeId) -> str:
    """The node agent's naming: each certificate is the SDS resource named by its SPIFFE ID."""
    return identity.uri


class CertificateScheduler:
    """Keeps one certificate per reported identity; see the module docstring."""

    def __init__(
        self,
        policy: RotationPolicy,
        key_spec: KeySpec,
        signer: CertificateSigner,
        cache: SecretCache,
        clock: Clock,
        *,
        metrics: AgentMetrics,
        trust_bundle: TrustBundleKeeper,
        resource_name: Callable[[SpiffeId], str] = publish_as_spiffe_id,
        impersonate: bool = False,
        max_concurrent: int = 1,
        start_hook: StartHook | None = None,
        restore_from: Path | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self.max_concurrent = max(1, max_concurrent)
        self._key_spec = key_spec
        self._signer = signer
        self._cache = cache
        self._clock = clock
        self._resource_name = resource_name
        self._impersonate = impersonate
        self._start_hook = start_hook
        self._restore_from = restore_from  # only for log lines
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._trust_bundle = trust_bundle
        self.queue = FetchQueue()
        self.states: dict[SpiffeId, IdentityState] = {}
        self.synced = False
        self.source_failure: str | None = None
        self.installs = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._workers: list[asyncio.Task[None]] = []
        self._removals: set[asyncio.Task[None]] = set()
        self.taints = KnownTaints()  # every source's taints (agent.taints)

    @classmethod
    def from_config(
        cls,
        config: AgentConfig,
        signer: CertificateSigner,
        cache: SecretCache,
        clock: Clock,
        *,
        metrics: AgentMetrics,
        trust_bundle: TrustBundleKeeper,
        start_hook: StartHook | None = None,
        rng: random.Random | None = None,
    ) -> CertificateScheduler:
        """The scheduler for a pod agent, or with `config.node_mode` a node agent: naming,
        impersonation, concurrency cap and backoff follow the mode."""
        node = config.node_mode
        policy = RotationPolicy(
            ttl=config.secret_ttl,
            grace_period_ratio=config.grace_period_ratio,
            grace_period_ratio_jitter=config.grace_period_ratio_jitter,
            backoff=NODE_BACKOFF if node else SINGLE_IDENTITY_BACKOFF,
            taint_resign_window=config.taint_resign_window,
        )
        return cls(
            policy,
            config.key_spec,
            signer,
            cache,
            clock,
            metrics=metrics,
            trust_bundle=trust_bundle,
            resource_name=publish_as_spiffe_id if node else publish_as_default,
            impersonate=node,
            max_concurrent=config.max_concurrent_fetches if node else 1,
            start_hook=start_hook,
            restore_from=config.output_certs,
            rng=rng,
        )

    # -- the identity source's side ---------------------------------------------------------

    def set_identities(self, identities: IdentitySet) -> None:
        """Reconciles with the source's snapshot (called on the event loop)."""
        self.synced = True
        self.source_failure = None
        for identity in sorted(identities, key=str):
            if identity not in self.states:
                log.info("identity %s to serve; fetching its certificate", identity)
                self.states[identity] = IdentityState(identity, self._resource_name(identity))
                self._enqueue(identity, FIRST)
        for identity in [i for i in self.states if i not in identities]:
            self._forget(identity)
        self._update_gauges()

    def source_failed(self, message: str) -> None:
        """The source could not tell the identities yet (e.g. no token); shown by readiness."""
        self.source_failure = message

    def _forget(self, identity: SpiffeId) -> None:
        state = self.states.pop(identity)
        state.cancel_timer()
        self.queue.discard(identity)
        log.info("identity %s is gone; no longer rotating its certificate", identity)
        self._metrics.secrets.forget(state.name)  # also if no certificate was served yet
        task = asyncio.get_running_loop().create_task(self._cache.remove(state.name))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    @property
    def identities(self) -> frozenset[SpiffeId]:
        return frozenset(self.states)

    def leaf_authorities(self) -> frozenset[str]:
        """The authorities (SKI hex) of every leaf served now: what the periodic report says."""
        return frozenset(s.authority for s in list(self.states.values()) if s.authority)

    def taints_learned(self, tainted_at: Mapping[str, datetime], source: str) -> int:
        """A source (`agent.taints`: the report answer, the taint notice) says these
        authorities are tainted (ID -> when, on this agent's clock). One path for every source:
        the taints join what is known (`KnownTaints`; a notice also drops the taints only
        earlier notices named), then every identity whose leaf a known tainted authority
        signed is re-signed at its own point of the policy's window
        (`RotationPolicy.taint_resign_delay`), unless it is due sooner anyway. Each
        certificate is rescheduled once, however often and from however many sources the
        taint is repeated, and each identity at most once per taint, whatever the CA answers
        the re-sign with. Returns how many identities were rescheduled now."""
        now = self._clock.now()
        learnt = self.taints.learn(tainted_at, source, now)
        if learnt.forgotten:
            gone = set(learnt.forgotten)
            for state in list(self.states.values()):
                state.forget_taints(gone)
        if not len(self.taints):
            return 0
        moved = [s for s in list(self.states.values()) if self._resign_if_tainted(s, now)]
        for authority in sorted({s.authority or "" for s in moved}):
            log.warning(
                "the CA has tainted authority %s (learnt from the %s): re-signing %d "
                "certificate(s) it signed within %s of the taint",
                authority,
                self.taints.source(authority),  # who named it, not who called now
                sum(1 for s in moved if s.authority == authority),
                self.policy.taint_resign_window,
            )
        return len(moved)

    def _resign_if_tainted(self, state: IdentityState, now: datetime) -> bool:
        """Moves this identity's renewal to its point of the taint window if a known tainted
        authority signed its leaf (once per certificate, and once per taint for the identity:
        `agent.taints` rule 5); True if it did."""
        authority = state.authority
        tainted_at = self.taints.get(authority)
        if (
            authority is None
            or tainted_at is None
            or state.current is None
            or state.taint_handled == state.generation
        ):
            return False
        state.taint_handled = state.generation
        if authority in state.resigned_for:
            return False  # re-signed early once for this taint already; `_install` said so
        since = (now - tainted_at).total_seconds()
        delay = self.policy.taint_resign_delay(since, self._rng)
        due = now + timedelta(seconds=delay)
        if state.identity in self.queue or (state.due_at is not None and state.due_at <= due):
            return False
        state.resigned_for[authority] = state.generation
        log.info(
            "the certificate for %s was signed by authority %s, which the CA has tainted; "
            "re-signing in %.1fs",
            state.identity,
            state.authority,
            delay,
        )
        state.next_rotation_at = due
        self._metrics.taint_resigns.inc()
        self._schedule(state, delay, RENEWAL)
        return True

    def request_rotation(self) -> None:
        """Renews every identity now (e.g. an operator signal); harmless if already queued."""
        for identity in list(self.states):
            self._enqueue(identity, RENEWAL)

    # -- readiness (agent.status.ReadinessSource) ------------------------------------------

    def has_valid_certificate(self, now: datetime | None = None) -> bool:
        """Ready: the source has reported and every known identity holds a valid certificate."""
        if not self.synced:
            return False
        now = now or self._clock.now()
        return all(state.valid(now) for state in list(self.states.values()))

    @property
    def last_error(self) -> str | None:
        """Why not ready, or the latest failure while ready; None when all is well."""
        if not self.synced:
            return self.source_failure or "the identity source has not reported any identity yet"
        now = self._clock.now()
        states = list(self.states.values())
        failed = [s for s in states if s.last_failure is not None]
        if len(states) == 1:  # the pod agent: its one failure, as is
            only = states[0].last_failure
            return only.message if only else None
        missing = [s for s in states if not s.valid(now)]
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
            asyncio.create_task(self._worker(), name=f"certificate-fetch-{i}")
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
                if not state.started:
                    state.started = True
                    if await self._restore(state):
                        continue
                await self._fetch_and_install(state)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not silently shrink the worker pool
                log.exception("unexpected error handling %s; retrying it later", identity)
                if self.states.get(identity) is state:
                    priority = RENEWAL if state.current else FIRST
                    self._schedule(state, self.policy.backoff.maximum, priority)

    async def _restore(self, state: IdentityState) -> bool:
        """Runs the start hook; logs one line saying what happened. True if installed."""
        if self._start_hook is None:
            return False
        where = self._restore_from or "the output directory"
        try:
            restored = await asyncio.to_thread(
                self._start_hook, state.identity, state.name, self._clock.now()
            )
        except NoPreviousCertificate:
            log.info("no certificate for %s from a previous run in %s", state.identity, where)
            return False
        except CertificateNotRestored as exc:
            log.warning(
                "not restoring the certificate files for %s in %s: %s; asking the CA",
                state.identity,
                where,
                exc,
            )
            return False
        except Exception:  # a bug in the checks must not stop the agent from asking the CA
            log.exception("could not check the certificate files in %s; asking the CA", where)
            return False
        if self.states.get(state.identity) is not state:
            return True  # gone meanwhile
        await self._install(state, restored.signed, restored.key_pem, restored.source)
        return True

    async def _fetch_and_install(self, state: IdentityState) -> None:
        identity = state.identity
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._update_gauges()
        try:
            key, csr = await asyncio.to_thread(new_key_and_csr, self._key_spec, identity)
            signed = await self._signer.sign(
                SigningRequest(
                    csr,
                    identity,
                    key,
                    self.policy.ttl,
                    impersonate=identity if self._impersonate else None,
                    renewal=state.valid(self._clock.now()),
                    leaf_authority=state.authority if state.current else None,
                )
            )
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
            log.debug("dropping the certificate for %s: it is gone meanwhile", identity)
            return
        await self._install(state, signed, private_key_to_pem(key).decode("ascii"))

    async def _install(
        self,
        state: IdentityState,
        signed: SignedCertificate,
        key_pem: str,
        restored_from: Path | None = None,
    ) -> None:
        """Publishes a certificate (from the CA, or `restored_from` a previous run's files) and
        schedules its renewal. The state changes only once the secrets are published (and so
        written out by the cache's listeners): readiness never runs ahead of SDS and files."""
        # Root first: a peer may already present a leaf from a new root.
        source = SOURCE_RESTORED if restored_from else SOURCE_CA_RESPONSE
        await self._trust_bundle.learn(signed.root_bundle_pem, source, replacing=state.name)
        await self._cache.publish(TlsSecret(state.name, signed.chain_pem, key_pem))
        await self._trust_bundle.recheck()
        if self.states.get(state.identity) is not state:  # it left while we published
            await self._cache.remove(state.name)
            return
        state.current = signed
        state.authority = leaf_authority(signed.leaf)
        state.restored = restored_from is not None
        state.generation += 1
        state.failures = 0
        state.last_failure = None
        self.installs += 1
        now = self._clock.now()
        delay = self.policy.renewal_delay(signed.not_after, signed.received_at, now, self._rng)
        state.next_rotation_at = now + timedelta(seconds=delay)
        counter = self._metrics.restores if restored_from else self._metrics.rotations
        counter.inc()
        self._metrics.secrets.renewed(
            state.name, signed.serial_hex, signed.received_at, state.next_rotation_at
        )
        log.info(
            "certificate serial %s for %s %s; expires %s, rotating in %.1fs",
            signed.serial_hex,
            ", ".join(describe_certificate(signed.leaf).uri_sans),
            f"restored from {restored_from} (previous run)" if restored_from else "installed",
            signed.not_after.isoformat(),
            delay,
        )
        self._schedule(state, delay, RENEWAL)
        if restored_from is not None:
            self._resign_if_tainted(state, now)  # a previous run's leaf of a tainted authority
        elif state.authority in state.resigned_for:
            # The one early re-sign for this taint is spent (agent.taints, rule 5): asking
            # again at every report would be a CSR per report for the agent's life.
            log.warning(
                "the CA signed the new certificate for %s with authority %s again, which the "
                "%s names as tainted (a CA process that has not caught up yet, or a taint "
                "notice naming the active authority?); not re-signing it early again for the "
                "same taint: it rotates at its normal point, in %.1fs",
                state.identity,
                state.authority,
                self.taints.source(state.authority),
                delay,
            )
        elif state.authority in self.taints:
            # Not re-signed at once (the CA process may not have caught up yet): the next
            # report or notice asks again, for this certificate, once (see above).
            log.warning(
                "the CA signed the new certificate for %s with authority %s, which it has "
                "tainted (a CA process that has not caught up yet?); asking again at the next "
                "report",
                state.identity,
                state.authority,
            )

    def _on_failure(self, state: IdentityState, exc: Exception) -> None:
        message = str(exc) or type(exc).__name__
        state.failures += 1
        now = self._clock.now()
        state.last_failure = FailureRecord(message, now, state.failures)
        self._metrics.rotation_failures.inc()
        self._metrics.secrets.renewal_failed(state.name, message, now)
        expires = state.current.not_after if state.current else None
        delay = self.policy.retry_delay(state.failures - 1, now, expires, self._rng)
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
        state.due_at = due_at
        state.timer = asyncio.create_task(self._timer(state, state.generation, due_at, priority))

    async def _timer(
        self, state: IdentityState, generation: int, due_at: datetime, priority: int
    ) -> None:
        # An absolute deadline: time spent before this task first runs is not added on top.
        await self._clock.sleep(max(0.0, (due_at - self._clock.now()).total_seconds()))
        self._on_due(state, generation, priority)

    def _on_due(self, state: IdentityState, generation: int, priority: int) -> None:
        """Timer callback: acts only for the certificate it was set for (see the docstring)."""
        if self.states.get(state.identity) is not state or state.generation != generation:
            log.debug("stale timer for %s (generation %d)", state.identity, generation)
            return
        state.timer = None
        state.due_at = None
        self._enqueue(state.identity, priority)

    def _enqueue(self, identity: SpiffeId, priority: int) -> None:
        self.queue.put(identity, priority)
        self._update_gauges()

    def _update_gauges(self) -> None:
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
