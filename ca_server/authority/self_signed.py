"""The self-signed authority driver: rotation of the authority slots every CA process shares.

Every CA process (worker, replica) runs a `SelfSignedDriver` over the shared
`AuthorityStateStore`. Each round it

1. applies whatever `slots.scheduled_step` says is due, inside a store transaction
   (so when several processes wake at once, exactly one performs the step and the others find
   it done), one persisted step at a time;
2. converges: if the stored state differs from what this process signs with (its own step,
   another process's, or `meshca authority`), it writes one audit line per change it has not
   seen yet (so every process's audit stream shows when *it* applied a change), swaps the
   signer's authority, rewrites `root-cert.pem` and the taint notice beside it
   (`meshca.taint_notice`), refreshes the expiry gauges and per-slot gauges, and tells
   Kubernetes mode (root ConfigMaps, which carry the same two documents);
3. sleeps until the next step is due or the poll interval passes, whichever is first.

Nothing signs with an authority that is not active: the signer only ever holds the active
slot of the last state it converged on, and a taint or activation made elsewhere reaches it
within one poll interval.

The signer, the ledger and the publication steps are the ones the plugged-in driver uses
(`driver_core`); the activation gate's coverage figure and deadline are the rules of
`ca_server.fleet.gate_coverage`, `slots.gate_deadline` and `slots.gate_verdict`, which the
plugged-in guard reads too.

Concurrency: the driver is a coroutine on the CA's event loop; store calls (file lock, disk,
API server) run in a worker thread. The signer (`signer.LocalSigner`) runs on the event loop
and reads its current authority once per request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from datetime import datetime

from prometheus_client import Counter, Gauge

from ca_server.authority.driver_core import DriverCore, DriverSettings
from ca_server.authority.report import AuthorityReport
from ca_server.authority.slots import (
    GATE_DEADLINE_REASON,
    GATE_WAITING,
    AuthorityState,
    HistoryEvent,
    Phase,
    SlotRotationPolicy,
    gate_waiting,
    next_due,
    scheduled_step,
)
from ca_server.authority.state_store import (
    AuthorityStateStore,
    SlotFactory,
    encode_state,
    state_digest,
)
from ca_server.config import CaConfig, TtlPolicy
from ca_server.errors import CaSetupError
from ca_server.fleet import AgentCoverage, FleetReports, authority_coverage, gate_coverage
from ca_server.metrics import CaMetrics, retire_series
from certs import SigningAuthority
from meshca.clock import Clock
from meshca.logs import audit

log = logging.getLogger(__name__)

_MAX_STEPS_PER_ROUND = 8
GATE_RUNBOOK = "docs/rotate-the-ca.md#gated-activation---activate-at-coverage"
_MIN_SLEEP = 0.05


class AuthorityGauges:
    """Per-slot gauges, labelled by authority ID (bounded: only slots in the state have series;
    a dropped or revoked authority's series are removed at once)."""

    def __init__(self, metrics: CaMetrics) -> None:
        r = metrics.registry
        self.phase = Gauge(
            "meshca_ca_authority_phase",
            "1 for the phase each authority is in (prepared, active, old)",
            ["authority", "phase"],
            registry=r,
            # With `meshca ca --workers N`: the state the latest-updating worker saw, once.
            multiprocess_mode="livemostrecent",
        )
        self.tainted = Gauge(
            "meshca_ca_authority_tainted",
            "1 if the authority is tainted",
            ["authority"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.not_after = Gauge(
            "meshca_ca_authority_not_after_timestamp",
            "Unix time the authority's certificate expires",
            ["authority"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.live_leaves = Gauge(
            "meshca_ca_authority_live_leaves",
            "Unexpired leaves this CA process signed with the authority",
            ["authority"],
            registry=r,
            multiprocess_mode="livesum",  # with workers: all of this CA's workers together
        )
        self._known: set[str] = set()
        self.trusting = Gauge(
            "meshca_ca_authority_agents_trusting",
            "Reporting agents whose trust bundle holds the authority (coverage numerator)",
            ["authority"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.serving = Gauge(
            "meshca_ca_authority_agents_serving",
            "Reporting agents still serving a leaf the authority signed (what revoking it "
            "would break; 0 before `meshca authority revoke`)",
            ["authority"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.reporting = Gauge(
            "meshca_ca_agents_reporting",
            "Agents that reported what they trust (coverage denominator; Istio's agents, which "
            "send no report, are not counted)",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.gate_waiting = Gauge(
            "meshca_ca_activation_gate_waiting",
            "1 while a due activation waits for --activate-at-coverage",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.unseen = Gauge(
            "meshca_ca_agents_unseen",
            "Agent reports the CA could not see (cut to fit a published report, evicted, or in "
            "a replica report that cannot be read): counted as not trusting and maybe serving",
            registry=r,
        )
        self.gate_deadline = Counter(
            "meshca_ca_activation_gate_deadline",
            "Activations this CA process saw made at the gate's deadline, below the coverage "
            "--activate-at-coverage asked for",
            registry=r,
        )

    def update(self, state: AuthorityState, live: dict[str, int]) -> None:
        present = {slot.id for slot in state.slots}
        for gone in self._known - present:
            for phase in Phase:
                retire_series(self.phase, gone, phase.value)
            gauges = (self.tainted, self.not_after, self.live_leaves, self.trusting, self.serving)
            for gauge in gauges:
                retire_series(gauge, gone)
        for slot in state.slots:
            for phase in Phase:
                self.phase.labels(slot.id, phase.value).set(1 if slot.phase is phase else 0)
            self.tainted.labels(slot.id).set(1 if slot.tainted else 0)
            self.not_after.labels(slot.id).set(slot.not_after.timestamp())
            self.live_leaves.labels(slot.id).set(live.get(slot.id, 0))
        self._known = present

    def coverage(self, state: AuthorityState, fleet: FleetReports) -> None:
        """Per authority, how many reporting agents trust it (every CA process's reports)."""
        counted = authority_coverage([(slot.id, slot.cert) for slot in state.slots], fleet)
        for slot in state.slots:
            if slot.id in self._known:  # `update` removes the series of a gone authority
                self.trusting.labels(slot.id).set(counted.trusting.get(slot.id, 0))
                self.serving.labels(slot.id).set(counted.serving.get(slot.id, 0))
        self.reporting.set(counted.reporting)
        self.unseen.set(counted.unseen + counted.unreadable)


def audit_events(events: tuple[HistoryEvent, ...], source: str) -> None:
    """One audit line per phase change, taint or revoke; `by` names who wrote the line (a CA
    process applying it, or the `meshca authority` command making it)."""
    for event in events:
        audit(
            f"authority-{event.event}",
            outcome=event.event,
            authority=event.authority,
            reason=event.reason,
            at=event.at.isoformat(),
            by=source,
        )


class SelfSignedDriver(DriverCore):
    """Self-signed authority slots, rotated on schedule (an `AuthorityDriver`)."""

    def __init__(
        self,
        store: AuthorityStateStore,
        policy: SlotRotationPolicy,
        factory: SlotFactory,
        metrics: CaMetrics,
        clock: Clock,
        settings: DriverSettings,
        ttl: TtlPolicy,
        on_change: Callable[[SigningAuthority], None] = lambda authority: None,
    ) -> None:
        super().__init__(settings, clock, metrics)
        self._store = store
        self.policy = policy
        self._factory = factory
        self.on_change = on_change
        self.ttl_policy = cap_leaf_lifetimes(ttl, policy)
        # What `/debug/ca` shows of the slots, rebuilt at the end of every round.
        self.report = AuthorityReport()
        self._report_failing = False
        self._gauges = AuthorityGauges(metrics)
        self._converged_digest = ""
        self._audited: set[HistoryEvent] = set()
        self._state: AuthorityState | None = None

    @property
    def state(self) -> AuthorityState:
        """The slot state this process last converged on (what it signs with)."""
        if self._state is None:
            raise RuntimeError("the authority driver has not started: await start() first")
        return self._state

    def tainted_since(self) -> dict[str, datetime]:
        """The taints of the slots this process follows (what the agent report answers)."""
        return self.state.tainted_since()

    def planned_handover(self) -> datetime | None:
        """When the active authority's successor is due to activate: the 5/6 point, or while
        the activation gate waits past it, the gate's deadline; None under manual rotation."""
        if self._state is None or not self.policy.automatic:
            return None
        active = self._state.active
        due = active.not_after - self.policy.activate_lead(active.lifetime)
        if self.policy.activate_at_coverage is not None and due <= self.clock.now():
            return self.policy.activation_deadline(active)
        return due

    def root_phases(self) -> dict[str, Phase]:
        """Each slot's phase by authority ID (the state this process converged on)."""
        return {slot.id: slot.phase for slot in self.state.slots}

    async def start(self) -> None:
        """Brings the shared state up to date and starts signing with its active slot."""
        before = await asyncio.to_thread(self._store.read)
        self._audited = set(before.history)
        state = await asyncio.to_thread(self._advance)
        self._converge(state)
        log.info(
            "signing with self-signed authority slots (trust domain %s)",
            self.settings.trust_domain,
        )
        await asyncio.to_thread(self._refresh_report)

    async def run(self) -> None:
        """Runs until cancelled; a failing round is logged and retried, never ends the loop
        (the CA keeps signing with the authority it has)."""
        seen = refused = ""
        while True:
            await self.clock.sleep(self._sleep_seconds())
            try:
                current = await asyncio.to_thread(self._store.fingerprint)
                due = self._step_due()
                if current != seen or due:
                    state = await asyncio.to_thread(self._advance)
                    self._converge(state)
                    seen = await asyncio.to_thread(self._store.fingerprint)
                elif self._state is not None:
                    self._gauges.update(self._state, self.ledger.live(self.clock.now()))
                await asyncio.to_thread(self.save_ledger)
                await asyncio.to_thread(self._refresh_report)
                refused = ""
            except CaSetupError as exc:
                # Unusable or untrustworthy state (e.g. a data directory others may write): one
                # line per distinct refusal, not a traceback every poll.
                if str(exc) != refused:
                    log.error("keeping the current authority: refusing to load it: %s", exc)
                refused = str(exc)
            except Exception:
                log.exception(
                    "keeping the current authority: updating from %s failed; retrying",
                    self._store.description,
                )

    # -- one round -------------------------------------------------------------------------

    def _advance(self) -> AuthorityState:
        """Applies every due step, each in its own transaction (blocking: worker thread)."""
        state = self._store.read()
        for _ in range(_MAX_STEPS_PER_ROUND):
            changed: list[bool] = []
            state = self._store.transact(functools.partial(self._scheduled, changed))
            if not any(changed):
                return state
        return state

    def _scheduled(self, changed: list[bool], current: AuthorityState) -> AuthorityState | None:
        """The store transaction's body: the due step, if any (noted in `changed`)."""
        now = self.clock.now()
        updated = scheduled_step(
            current,
            self.policy,
            now,
            lambda: self._factory.new(now, Phase.PREPARED),
            lambda: self.settings.ledger_sink.live(now),
            functools.partial(self._coverage_of, current, now),
        )
        changed[:] = [updated is not None]
        return updated

    def _coverage_of(self, state: AuthorityState, now: datetime, ident: str) -> AgentCoverage:
        """The activation gate's figure, from every CA process's agent reports (the same
        merge and rule as `meshca authority show` and the plugged-in guard)."""
        fleet = self.settings.ledger_sink.agents(now)
        return gate_coverage([(slot.id, slot.cert) for slot in state.slots], fleet, ident)

    def _converge(self, state: AuthorityState) -> None:
        digest = state_digest(encode_state(state))
        if digest == self._converged_digest and self._state is not None:
            self._gauges.update(state, self.ledger.live(self.clock.now()))
            return
        fresh = tuple(e for e in state.history if e not in self._audited)
        audit_events(fresh, self.settings.instance)
        self._audited.update(fresh)
        self._gate_news(fresh)
        self._gauges.gate_waiting.set(1 if gate_waiting(state) is not None else 0)
        previous = self._state
        if previous is not None and (
            previous.active.id != state.active.id or previous.bundle != state.bundle
        ):
            log.info(
                "authorities changed: active %s, bundle [%s]",
                state.active.id,
                ", ".join(
                    f"{s.id} {s.phase}{' tainted' if s.tainted else ''}" for s in state.slots
                ),
            )
        self._state = state
        # Istio's expiry gauges describe the active authority: the root that signs now, which
        # a rotation replaces before it expires.
        self.adopt(
            state.signing_authority(),
            state.active.id,
            state.untainted_roots,
            state.tainted_since(),
            gauge_root=state.active.cert,
        )
        self._gauges.update(state, self.ledger.live(self.clock.now()))
        self._converged_digest = digest

    def _gate_news(self, fresh: tuple[HistoryEvent, ...]) -> None:
        """Says loudly when the activation gate gave up waiting (the operator should find out
        why agents did not get the new bundle), and when it starts waiting."""
        for event in fresh:
            if event.event == "activated" and event.reason.startswith(GATE_DEADLINE_REASON):
                self._gauges.gate_deadline.inc()
                log.warning(
                    "activated authority %s without the wanted coverage: %s. Agents that do "
                    "not trust it yet fail to verify its leaves until they get the new bundle: "
                    "check their root-cert.pem source (%s)",
                    event.authority,
                    event.reason,
                    GATE_RUNBOOK,
                )
            elif event.event == GATE_WAITING:
                log.info("activation of authority %s: %s", event.authority, event.reason)

    def _step_due(self) -> bool:
        if self._state is None:
            return False
        due = next_due(self._state, self.policy)
        return due is not None and due <= self.clock.now()

    def _sleep_seconds(self) -> float:
        interval = self.settings.poll_interval
        if self._state is None:
            return interval
        due = next_due(self._state, self.policy)
        if due is None:
            return interval
        until = (due - self.clock.now()).total_seconds()
        if until <= 0:
            return interval  # due but held back (an old authority's leaves are still live)
        return max(_MIN_SLEEP, min(interval, until))

    def _refresh_report(self) -> None:
        """Rebuilds `report` from the converged state and every process's published figures
        (blocking: worker thread). In Kubernetes mode that is one list of the replica
        ConfigMaps per round. A figure that cannot be read is shown as unknown; the failure is
        logged once per run of failures, not every round."""
        if self._state is None:
            return
        now = self.clock.now()
        sink = self.settings.ledger_sink
        live: dict[str, int] | None = None
        fleet: FleetReports | None = None
        try:
            live, fleet = sink.figures(now)
            self._report_failing = False
        except Exception as exc:  # an API or file failure must not hide the slots themselves
            if not self._report_failing:
                log.warning("cannot read the CA processes' reports for /debug/ca: %s", exc)
            self._report_failing = True
        self.report.update(self._state, live, fleet, now)
        if fleet is not None:
            self._gauges.coverage(self._state, fleet)


def cap_leaf_lifetimes(ttl: TtlPolicy, policy: SlotRotationPolicy) -> TtlPolicy:
    """Lowers the workload TTLs so no leaf outlives the activation lead (a rotation must never
    cut a leaf short); says so when it changes anything."""
    cap = policy.max_leaf_ttl
    if ttl.maximum <= cap:
        return ttl
    maximum = cap
    default = min(ttl.default, maximum)
    capped = TtlPolicy(default=default, maximum=maximum, minimum=min(ttl.minimum, default))
    log.warning(
        "capping workload certificate TTLs at %s (was maximum %s, default %s): with a CA "
        "lifetime of %s, a longer leaf signed just before rotation would be cut short",
        maximum,
        ttl.maximum,
        ttl.default,
        policy.lifetime,
    )
    return capped


def rotation_policy_for(config: CaConfig) -> SlotRotationPolicy:
    """The schedule from the CA's configuration. Replicas notice a change within one poll, so
    three polls is a safe convergence margin before an old root may leave the bundle."""
    return SlotRotationPolicy(
        lifetime=config.root_lifetime,
        prepare_cap=config.root_prepare_cap,
        activate_cap=config.root_activate_cap,
        convergence=config.plugged_ca_poll_interval * 3,
        automatic=config.root_rotation,
        activate_at_coverage=config.activate_at_coverage,
        activate_deadline=config.activate_deadline,
    )
