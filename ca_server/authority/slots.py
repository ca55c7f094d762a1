"""The CA's authorities as slots (SPIRE's model): what exists, in which phase, and what may change.

An authority is a key and its self-signed certificate, named by the certificate's Subject Key ID
in hex. Each one sits in a slot whose phase is

- `prepared`: in the trust bundle, not signing yet (workloads learn it before they need it);
- `active`: the one authority that signs (exactly one at any time);
- `old`: no longer signing, kept in the bundle until the last leaf it signed has expired,

and any `old` one may also be `tainted` (compromised: no longer trusted for new signatures or as
a client certificate's anchor, but still in the bundle until an operator revokes it).

This module is pure: the predicates (`should_prepare`, `should_activate`, `may_drop`) and the
transitions take `now` and return a new `AuthorityState`; nothing here reads files, the clock or
the cluster. `ca_server.authority.self_signed` is the one driver that applies them on a clock, and
`ca_server.authority.state_store` persists the result where every CA replica sees it.

Rotation timing (self-signed mode) follows SPIRE: prepare when half the active authority's life
is left (never more than `prepare_cap` ahead of its expiry), activate when a sixth is left (never
more than `activate_cap` ahead). Because a leaf signed just before activation lives at most the
time left, the maximum leaf lifetime is capped at that lead (`SlotRotationPolicy.max_leaf_ttl`), so
a rotation never shortens a leaf below what it asked for.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from cryptography import x509

from ca_server.fleet import AgentCoverage
from certs import PrivateKey, SigningAuthority

HISTORY_LIMIT = 50
ID_PREFIX_MIN = 8
"""The fewest hex digits of an authority ID `meshca authority` accepts as a prefix."""
_HEX_DIGITS = frozenset("0123456789abcdef")


class Phase(enum.StrEnum):
    PREPARED = "prepared"
    ACTIVE = "active"
    OLD = "old"


class AuthorityCommandError(Exception):
    """An operator's request (or a scheduled step) that would break trust; the message says why
    and what to do instead."""


def authority_id(cert: x509.Certificate) -> str:
    """The Subject Key ID in hex (what `meshca authority` and the metrics call the authority);
    computed from the public key when the certificate carries none."""
    try:
        ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        ski = x509.SubjectKeyIdentifier.from_public_key(cert.public_key())
    return ski.digest.hex()


@dataclass(frozen=True)
class Slot:
    """One authority and its phase. `issued_at` is when its life started (NotBefore minus the
    clock-skew backdate for roots meshca made), used for the ½ and ⅚ points."""

    cert: x509.Certificate
    key: PrivateKey = field(repr=False)
    phase: Phase
    issued_at: datetime
    tainted: bool = False
    # When it stopped signing (became old): the latest leaf it signed expires at most
    # `max_leaf_ttl` after this.
    retired_at: datetime | None = None

    @property
    def id(self) -> str:
        return authority_id(self.cert)

    @property
    def not_after(self) -> datetime:
        return self.cert.not_valid_after_utc

    @property
    def not_before(self) -> datetime:
        return self.cert.not_valid_before_utc

    @property
    def lifetime(self) -> timedelta:
        return self.not_after - self.issued_at


@dataclass(frozen=True)
class HistoryEvent:
    at: datetime
    # prepared | activated | retired | dropped | tainted | revoked | adopted | activation-gated
    event: str
    authority: str
    reason: str = ""


@dataclass(frozen=True)
class SlotRotationPolicy:
    """When the driver prepares, activates and drops authorities."""

    lifetime: timedelta = timedelta(days=3650)
    prepare_cap: timedelta = timedelta(days=180)
    activate_cap: timedelta = timedelta(days=90)
    # How long after a change every replica is known to have seen it (a few polls).
    convergence: timedelta = timedelta(seconds=15)
    automatic: bool = True
    # The activation gate (`--activate-at-coverage`): at the 5/6 point, activate only once this
    # fraction of reporting agents trusts the prepared authority; None: by the clock alone.
    activate_at_coverage: float | None = None
    # ... but never later than this share of the activation lead past the 5/6 point: leaves
    # signed while waiting end with the active authority, so they get at least
    # (1 - share) * max_leaf_ttl.
    activate_deadline: float = 0.5

    def __post_init__(self) -> None:
        if self.activate_cap >= self.prepare_cap:
            raise ValueError(
                f"the activation lead ({self.activate_cap}) must be shorter than the preparation "
                f"lead ({self.prepare_cap})"
            )
        if self.activate_at_coverage is not None and not 0 < self.activate_at_coverage <= 1:
            raise ValueError(
                f"the activation coverage ({self.activate_at_coverage}) must be in (0, 1]"
            )
        if not 0 <= self.activate_deadline < 1:
            raise ValueError(
                f"the activation deadline ({self.activate_deadline}) must be in [0, 1)"
            )

    def prepare_lead(self, lifetime: timedelta) -> timedelta:
        return min(lifetime / 2, self.prepare_cap)

    def activate_lead(self, lifetime: timedelta) -> timedelta:
        return min(lifetime / 6, self.activate_cap)

    @property
    def max_leaf_ttl(self) -> timedelta:
        """The longest leaf the CA may sign so that activation never cuts one short: a leaf
        signed just before activation must still fit in the old authority's remaining life."""
        return self.activate_lead(self.lifetime)

    def should_prepare(self, active: Slot, now: datetime) -> bool:
        return now >= active.not_after - self.prepare_lead(active.lifetime)

    def should_activate(self, active: Slot, now: datetime) -> bool:
        return now >= active.not_after - self.activate_lead(active.lifetime)

    def activation_deadline(self, active: Slot) -> datetime:
        """When a gated activation happens whatever the coverage: the gate's one deadline rule,
        counted from the start of the activation window."""
        since = active.not_after - self.activate_lead(active.lifetime)
        return gate_deadline(since, active.not_after, self.activate_deadline)

    def may_drop(self, old: Slot, now: datetime, max_leaf_ttl: timedelta) -> bool:
        """An old authority (tainted or not) leaves the bundle once no leaf it signed can still be
        valid: `max_leaf_ttl` (plus the time replicas need to notice) after it stopped signing,
        or at its own expiry, whichever comes first."""
        if now >= old.not_after:
            return True
        retired = old.retired_at or now
        return now >= retired + max_leaf_ttl + self.convergence


@dataclass(frozen=True)
class AuthorityState:
    """All slots (at most one prepared and one active) plus a bounded history of changes."""

    slots: tuple[Slot, ...]
    history: tuple[HistoryEvent, ...] = ()

    # -- reading ---------------------------------------------------------------------------

    @property
    def active(self) -> Slot:
        for slot in self.slots:
            if slot.phase is Phase.ACTIVE:
                return slot
        raise AuthorityCommandError("no active authority in the shared state")

    @property
    def prepared(self) -> Slot | None:
        return next((s for s in self.slots if s.phase is Phase.PREPARED), None)

    @property
    def old(self) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.phase is Phase.OLD)

    def find(self, ident: str) -> Slot:
        """A slot by its ID, or by a prefix of at least `ID_PREFIX_MIN` hex digits that starts
        exactly one ID. A refusal says which rule the ID broke (not hex, too short, ambiguous,
        unknown) and lists the authorities, so the operator can copy the right one."""
        wanted = ident.strip().lower()
        known = "; the authorities are: " + ", ".join(f"{s.id} ({s.phase})" for s in self.slots)
        if not wanted or any(c not in _HEX_DIGITS for c in wanted):
            raise AuthorityCommandError(
                f"{ident!r} is not an authority ID (IDs are hex digits){known}"
            )
        exact = [s for s in self.slots if s.id == wanted]
        if exact:
            return exact[0]
        matches = [s for s in self.slots if s.id.startswith(wanted)]
        if len(wanted) < ID_PREFIX_MIN:
            raise AuthorityCommandError(
                f"{ident!r} is too short: give at least {ID_PREFIX_MIN} hex digits of an ID "
                f"({len(matches)} authorities start with it){known}"
            )
        if len(matches) > 1:
            raise AuthorityCommandError(
                f"{ident!r} is ambiguous: {len(matches)} authorities start with it "
                f"({', '.join(s.id for s in matches)}); give more digits"
            )
        if not matches:
            raise AuthorityCommandError(f"{ident!r} is not a known authority{known}")
        return matches[0]

    def only(self, ident: str) -> AuthorityState:
        """The same state narrowed to the one slot `ident` names (`meshca authority show ID`);
        the history is kept, so the activation gate of that slot still shows."""
        return AuthorityState((self.find(ident),), self.history)

    def ranked(self) -> tuple[Slot, ...]:
        """Active first, then prepared, then the old ones (newest first)."""
        order = {Phase.ACTIVE: 0, Phase.PREPARED: 1, Phase.OLD: 2}
        return tuple(sorted(self.slots, key=lambda s: (order[s.phase], -s.issued_at.timestamp())))

    @property
    def bundle(self) -> tuple[x509.Certificate, ...]:
        """The trust bundle workloads verify with: every slot's certificate."""
        return tuple(s.cert for s in self.ranked())

    @property
    def untainted_roots(self) -> tuple[x509.Certificate, ...]:
        """Anchors a client certificate may chain to (renewal over mTLS): a tainted authority
        is no longer trusted to vouch for anyone."""
        return tuple(s.cert for s in self.ranked() if not s.tainted)

    def tainted_since(self) -> dict[str, datetime]:
        """When each tainted authority was tainted (what agents pace their re-signing from):
        its latest `tainted` history event, or when it stopped signing if the bounded history
        no longer holds that event (a taint always comes after retirement)."""
        when = {e.authority: e.at for e in self.history if e.event == "tainted"}
        return {
            s.id: when.get(s.id) or s.retired_at or s.issued_at for s in self.slots if s.tainted
        }

    def signing_authority(self) -> SigningAuthority:
        """What the CA signs with: the active authority, presenting the whole bundle."""
        active = self.active
        return SigningAuthority(
            cert=active.cert, key=active.key, intermediates=(), roots=self.bundle
        )

    # -- changing --------------------------------------------------------------------------

    def _with(self, slots: list[Slot], *events: HistoryEvent) -> AuthorityState:
        history = (*self.history, *events)[-HISTORY_LIMIT:]
        return AuthorityState(tuple(slots), history)

    def noted(self, event: HistoryEvent) -> AuthorityState:
        """The same slots with one more history event (a decision worth auditing)."""
        return self._with(list(self.slots), event)

    def _replace_slot(self, old: Slot, new: Slot) -> list[Slot]:
        return [new if s is old else s for s in self.slots]

    def prepare(self, make: Callable[[], Slot], now: datetime, reason: str) -> AuthorityState:
        if self.prepared is not None:
            raise AuthorityCommandError(
                f"authority {self.prepared.id} is already prepared; activate it first "
                "(`meshca authority activate`)"
            )
        slot = make()
        if slot.phase is not Phase.PREPARED:
            raise ValueError("a new authority must start prepared")
        return self._with([*self.slots, slot], HistoryEvent(now, "prepared", slot.id, reason))

    def activate(self, ident: str | None, now: datetime, reason: str) -> AuthorityState:
        """The prepared authority becomes active; the active one becomes old."""
        prepared = self.prepared
        if ident is not None:
            target = self.find(ident)
            if target.phase is not Phase.PREPARED:
                raise AuthorityCommandError(
                    f"authority {target.id} is {target.phase}, not prepared: only a prepared "
                    "authority (already in every workload's trust bundle) may be activated; run "
                    "`meshca authority prepare` and wait for it to reach the workloads"
                )
            prepared = target
        if prepared is None:
            raise AuthorityCommandError(
                "no prepared authority to activate; run `meshca authority prepare` first"
            )
        current = self.active
        slots = []
        for slot in self.slots:
            if slot is prepared:
                slots.append(replace(slot, phase=Phase.ACTIVE))
            elif slot is current:
                slots.append(replace(slot, phase=Phase.OLD, retired_at=now))
            else:
                slots.append(slot)
        return self._with(
            slots,
            HistoryEvent(now, "activated", prepared.id, reason),
            HistoryEvent(now, "retired", current.id, reason),
        )

    def taint(self, ident: str, now: datetime) -> AuthorityState:
        target = self.find(ident)
        if target.phase is Phase.ACTIVE:
            raise AuthorityCommandError(
                f"authority {target.id} is active: tainting it would leave the CA nothing to sign "
                "with; run `meshca authority prepare` and `activate` first, then taint it"
            )
        if target.phase is Phase.PREPARED:
            raise AuthorityCommandError(
                f"authority {target.id} is prepared and has signed nothing; to discard a "
                "suspect prepared key, activate a fresh one instead of tainting this one"
            )
        if target.tainted:
            raise AuthorityCommandError(f"authority {target.id} is already tainted")
        slots = self._replace_slot(target, replace(target, tainted=True))
        return self._with(slots, HistoryEvent(now, "tainted", target.id, "operator"))

    def revoke(self, ident: str, now: datetime) -> AuthorityState:
        target = self.find(ident)
        if not target.tainted:
            raise AuthorityCommandError(
                f"authority {target.id} is not tainted: revoke removes an authority from every "
                "trust bundle at once, so it is only allowed after `meshca authority taint` "
                "(and after the workloads holding its leaves have re-signed)"
            )
        slots = [s for s in self.slots if s is not target]
        return self._with(slots, HistoryEvent(now, "revoked", target.id, "operator"))

    def drop(self, slot: Slot, now: datetime, reason: str) -> AuthorityState:
        if slot.phase is not Phase.OLD:
            raise AuthorityCommandError(f"authority {slot.id} is {slot.phase}; only old ones go")
        slots = [s for s in self.slots if s is not slot]
        return self._with(slots, HistoryEvent(now, "dropped", slot.id, reason))


GATE_WAITING = "activation-gated"
"""History event: the prepared authority's activation is due but waits for coverage."""
GATE_DEADLINE_REASON = "gate deadline passed"
"""Start of an `activated` event's reason when the gate gave up waiting."""


def gate_deadline(since: datetime, expires: datetime, share: float) -> datetime:
    """The activation gate's deadline (self-signed slots and the plugged-in guard alike): a
    move held back for coverage since `since` happens anyway once `share` of the time left
    until the current authority `expires` has passed, before its leaves get too short."""
    return since + (expires - since) * share


class GateVerdict(enum.StrEnum):
    COVERED = "covered"  # enough reporting agents trust the new authority: move now
    DEADLINE = "deadline"  # not covered, but the deadline passed: move anyway, loudly
    WAIT = "wait"  # hold the move back and look again at the next poll


def gate_verdict(
    covered: AgentCoverage, fraction: float, deadline: datetime, now: datetime
) -> GateVerdict:
    """The activation gate's one rule (self-signed activation and plugged-in switch alike)."""
    if covered.reaches(fraction):
        return GateVerdict.COVERED
    return GateVerdict.DEADLINE if now >= deadline else GateVerdict.WAIT


def gate_waiting(state: AuthorityState) -> HistoryEvent | None:
    """The gate's waiting event for the prepared authority, if activation is being held."""
    prepared = state.prepared
    if prepared is None:
        return None
    for event in reversed(state.history):
        if event.authority == prepared.id:
            return event if event.event == GATE_WAITING else None
    return None


def _gated_activation(
    state: AuthorityState,
    policy: SlotRotationPolicy,
    now: datetime,
    coverage_of: Callable[[str], AgentCoverage],
) -> AuthorityState | None:
    """The activation at the 5/6 point under `--activate-at-coverage`: now if covered, at the
    deadline anyway (with a reason that says so), else one `activation-gated` event (so `show`
    and the audit stream say it waits) and nothing until the next call."""
    prepared, active = state.prepared, state.active
    assert prepared is not None and policy.activate_at_coverage is not None
    fraction = policy.activate_at_coverage
    covered = coverage_of(prepared.id)
    deadline = policy.activation_deadline(active)
    verdict = gate_verdict(covered, fraction, deadline, now)
    if verdict is GateVerdict.COVERED:
        return state.activate(
            None, now, f"scheduled: five sixths of the active authority's life; {covered}"
        )
    if verdict is GateVerdict.DEADLINE:
        return state.activate(
            None,
            now,
            f"{GATE_DEADLINE_REASON}: only {covered} (wanted {fraction:.0%}); activated "
            "anyway before the active authority's leaves get too short",
        )
    if gate_waiting(state) is not None:
        return None
    reason = (
        f"waiting until {fraction:.0%} of reporting agents trust it; "
        f"activates anyway at {deadline.isoformat()}"
    )
    return state.noted(HistoryEvent(now, GATE_WAITING, prepared.id, reason))


def scheduled_step(
    state: AuthorityState,
    policy: SlotRotationPolicy,
    now: datetime,
    new_slot: Callable[[], Slot],
    live_leaves: Callable[[], Mapping[str, int]] = dict,
    coverage_of: Callable[[str], AgentCoverage] | None = None,
) -> AuthorityState | None:
    """The next automatic change due at `now`, or `None` when nothing is due.

    One step per call (the driver calls again at once when something changed), so each phase
    change is persisted and audited on its own. `live_leaves` (asked only when an old
    authority's time is up) is the leaf ledger's count per authority: an old authority that
    still has live leaves stays — say the maximum TTL was lowered since they were signed — until
    they expire or the authority itself does. `coverage_of` (asked only when a gated
    activation is due) says how many reporting agents trust an authority.
    """
    max_leaf = policy.max_leaf_ttl
    for old in state.old:
        if not policy.may_drop(old, now, max_leaf):
            continue
        if now < old.not_after and live_leaves().get(old.id, 0) > 0:
            continue
        return state.drop(old, now, "its last leaf has expired")
    if not policy.automatic:
        return None
    active = state.active
    if state.prepared is None and policy.should_prepare(active, now):
        return state.prepare(new_slot, now, "scheduled: half of the active authority's life")
    if state.prepared is not None and policy.should_activate(active, now):
        if policy.activate_at_coverage is not None and coverage_of is not None:
            return _gated_activation(state, policy, now, coverage_of)
        return state.activate(None, now, "scheduled: five sixths of the active authority's life")
    return None


def next_due(state: AuthorityState, policy: SlotRotationPolicy) -> datetime | None:
    """When `scheduled_step` will next have something to do (so the driver can sleep until
    then instead of polling a one-minute test CA every five seconds)."""
    max_leaf = policy.max_leaf_ttl
    times = [
        min(old.not_after, (old.retired_at or old.not_after) + max_leaf + policy.convergence)
        for old in state.old
    ]
    if policy.automatic:
        active = state.active
        lead = (
            policy.prepare_lead(active.lifetime)
            if state.prepared is None
            else policy.activate_lead(active.lifetime)
        )
        times.append(active.not_after - lead)
    return min(times, default=None)
