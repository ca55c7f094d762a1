"""The JWT-SVID signing keys as slots — the X.509 authority's phases, for a key with no certificate.

Each key sits in the same phases as an X.509 authority (`ca_server.authority.Phase`): `prepared`
(published in the JWT bundle and the discovery JWKS, not signing), `active` (the one key that
signs), `old` (no longer signing, still published so the tokens it signed verify), and an `old`
key may be `tainted` (agents drop the tokens it signed) and then revoked (unpublished at once).
The same operator rules hold: only a prepared key activates, only an old one is tainted, only a
tainted one is revoked.

**An old key stays published until it is revoked or expires.** No token outlives its key (a
token's `exp` is capped at the key's `not_after`), so past its expiry a key verifies nothing and
leaves the JWKS by itself; before that only the operator's revoke removes it, whatever the
tokens' TTL: a relying party that caches a token's verdict, a clock that runs behind, or an
operator who activated early (a suspected compromise) all keep being served by the JWKS until
the operator decides otherwise. With the schedule below that is one old key for the last
sixth of its life.

Activation waits for three things: the clock's 5/6 point; publication for `jwks_max_age` (the
`Cache-Control: max-age` the discovery endpoint advertises: relying parties outside the mesh
cache the JWKS and no agent report can see them); and the agents' coverage — `activate_at_coverage`
of the agents that hold a JWT bundle report holding the prepared kid
(`ca_server.fleet.jwt_coverage`, with the X.509 gate's conservative rules and its verdict,
`ca_server.authority.gate_verdict`). Coverage gives way at the gate's deadline (the X.509
rule, `gate_deadline` with `activate_deadline`) or two tokens' lives before the active key
expires, whichever is first, with a reason that says so; while it waits, one
`activation-gated` event says why (what `meshca authority show --jwt` prints).

**An active key that can no longer sign** (the CA was down past its rotation, or the prepared
key was never published long enough) is replaced at once under automatic rotation: a usable
prepared key is activated, else a new one is prepared and activated — no waiting for the JWKS
cache lifetime or coverage, since no token can be signed meanwhile (minting answers
`UNAVAILABLE`); relying parties that cached the JWKS refuse the new kid until they refetch.

Pure: `now` is passed in; nothing here reads files or clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from ca_server.authority import (
    GATE_DEADLINE_REASON,
    GATE_WAITING,
    AuthorityCommandError,
    GateVerdict,
    Phase,
    gate_deadline,
    gate_verdict,
)
from ca_server.fleet import AgentCoverage
from certs import PrivateKey
from certs.jwk import jwk_thumbprint, key_algorithm, public_jwk

HISTORY_LIMIT = 50
KID_PREFIX_MIN = 8
# A key closer than this to its expiry signs nothing: a shorter token is not worth handing out.
MIN_TOKEN_LIFETIME = timedelta(seconds=30)


@dataclass(frozen=True)
class JwtKey:
    key: PrivateKey = field(repr=False)
    phase: Phase
    created_at: datetime
    not_after: datetime  # no token it signs outlives this
    tainted: bool = False
    retired_at: datetime | None = None
    activated_at: datetime | None = None

    @property
    def kid(self) -> str:
        return jwk_thumbprint(self.key)

    @property
    def algorithm(self) -> str:
        return key_algorithm(self.key)

    @property
    def lifetime(self) -> timedelta:
        return self.not_after - self.created_at

    def can_sign(self, now: datetime) -> bool:
        """Whether a token signed now would live at least `MIN_TOKEN_LIFETIME`."""
        return now + MIN_TOKEN_LIFETIME <= self.not_after

    def jwk(self) -> dict[str, str]:
        return public_jwk(self.key)


@dataclass(frozen=True)
class JwtEvent:
    at: datetime
    # prepared | activated | retired | dropped | tainted | revoked | activation-gated
    event: str
    kid: str
    reason: str = ""


@dataclass(frozen=True)
class JwtKeyPolicy:
    """When the driver prepares, activates and drops JWT keys."""

    lifetime: timedelta = timedelta(days=1)
    max_token_ttl: timedelta = timedelta(minutes=5)
    jwks_max_age: timedelta = timedelta(minutes=5)  # what relying parties may cache
    convergence: timedelta = timedelta(seconds=15)  # every replica has seen a change
    automatic: bool = True
    # The coverage gate: this share of the agents holding a JWT bundle hold the prepared key...
    activate_at_coverage: float = 1.0
    # ... or this share of the time from the 5/6 point to the active key's expiry has passed.
    activate_deadline: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.activate_at_coverage <= 1:
            raise ValueError(
                f"the JWT activation coverage ({self.activate_at_coverage}) must be in (0, 1]"
            )
        if not 0 <= self.activate_deadline < 1:
            raise ValueError(
                f"the JWT activation deadline ({self.activate_deadline}) must be in [0, 1)"
            )
        if self.activate_lead <= self.max_token_ttl:
            raise ValueError(
                f"the JWT key lifetime ({self.lifetime}) must be more than six times the "
                f"longest JWT-SVID ({self.max_token_ttl}): a token signed just before a rotation "
                "must fit in its key's remaining life"
            )

    @property
    def prepare_lead(self) -> timedelta:
        return self.lifetime / 2

    @property
    def activate_lead(self) -> timedelta:
        return self.lifetime / 6

    def coverage_deadline(self, active: JwtKey) -> datetime:
        """When the coverage gate gives way: the X.509 gate's deadline from the 5/6 point, but
        never later than two tokens' lives before the active key expires (the tokens it signs
        while waiting are cut to its remaining life)."""
        since = active.not_after - self.activate_lead
        deadline = gate_deadline(since, active.not_after, self.activate_deadline)
        return min(deadline, active.not_after - 2 * self.max_token_ttl)

    def published_long_enough(self, prepared: JwtKey, now: datetime) -> bool:
        """The activation rule relying parties need: the key has been in the JWKS at least
        as long as they may cache it (plus the replicas' convergence)."""
        return now >= prepared.created_at + self.jwks_max_age + self.convergence


@dataclass(frozen=True)
class JwtKeyState:
    keys: tuple[JwtKey, ...]
    history: tuple[JwtEvent, ...] = ()

    @property
    def active(self) -> JwtKey:
        for key in self.keys:
            if key.phase is Phase.ACTIVE:
                return key
        raise AuthorityCommandError("no active JWT-SVID key in the shared state")

    @property
    def prepared(self) -> JwtKey | None:
        return next((k for k in self.keys if k.phase is Phase.PREPARED), None)

    @property
    def old(self) -> tuple[JwtKey, ...]:
        return tuple(k for k in self.keys if k.phase is Phase.OLD)

    def ranked(self) -> tuple[JwtKey, ...]:
        order = {Phase.ACTIVE: 0, Phase.PREPARED: 1, Phase.OLD: 2}
        return tuple(sorted(self.keys, key=lambda k: (order[k.phase], -k.created_at.timestamp())))

    def published(self) -> tuple[dict[str, str], ...]:
        """The JWKS's keys: every key in a slot (prepared, active, old, tainted) — a key leaves
        only when dropped or revoked."""
        return tuple(k.jwk() for k in self.ranked())

    def tainted_kids(self) -> tuple[str, ...]:
        return tuple(k.kid for k in self.keys if k.tainted)

    def find(self, kid: str) -> JwtKey:
        wanted = kid.strip()
        known = "; the JWT keys are: " + ", ".join(f"{k.kid} ({k.phase})" for k in self.keys)
        exact = [k for k in self.keys if k.kid == wanted]
        if exact:
            return exact[0]
        if len(wanted) < KID_PREFIX_MIN:
            raise AuthorityCommandError(
                f"{kid!r} is too short: give at least {KID_PREFIX_MIN} characters of a kid{known}"
            )
        matches = [k for k in self.keys if k.kid.startswith(wanted)]
        if len(matches) != 1:
            what = "ambiguous" if matches else "not a known JWT key"
            raise AuthorityCommandError(f"{kid!r} is {what}{known}")
        return matches[0]

    # -- changing --------------------------------------------------------------------------

    def _with(self, keys: list[JwtKey], *events: JwtEvent) -> JwtKeyState:
        return JwtKeyState(tuple(keys), (*self.history, *events)[-HISTORY_LIMIT:])

    def prepare(self, make: Callable[[], JwtKey], now: datetime, reason: str) -> JwtKeyState:
        if self.prepared is not None:
            raise AuthorityCommandError(
                f"JWT key {self.prepared.kid} is already prepared; activate it first "
                "(`meshca authority activate --jwt`)"
            )
        key = make()
        return self._with([*self.keys, key], JwtEvent(now, "prepared", key.kid, reason))

    def activate(self, kid: str | None, now: datetime, reason: str) -> JwtKeyState:
        prepared = self.prepared
        if kid is not None:
            target = self.find(kid)
            if target.phase is not Phase.PREPARED:
                raise AuthorityCommandError(
                    f"JWT key {target.kid} is {target.phase}, not prepared: only a prepared key "
                    "(already in every JWT bundle) may be activated; run `meshca authority "
                    "prepare --jwt` and wait for it to reach the agents and relying parties"
                )
            prepared = target
        if prepared is None:
            raise AuthorityCommandError(
                "no prepared JWT key to activate; run `meshca authority prepare --jwt` first"
            )
        current = self.active
        keys = []
        for key in self.keys:
            if key is prepared:
                keys.append(replace(key, phase=Phase.ACTIVE, activated_at=now))
            elif key is current:
                keys.append(replace(key, phase=Phase.OLD, retired_at=now))
            else:
                keys.append(key)
        return self._with(
            keys,
            JwtEvent(now, "activated", prepared.kid, reason),
            JwtEvent(now, "retired", current.kid, reason),
        )

    def taint(self, kid: str, now: datetime) -> JwtKeyState:
        target = self.find(kid)
        if target.phase is not Phase.OLD:
            raise AuthorityCommandError(
                f"JWT key {target.kid} is {target.phase}: only an old key (no longer signing) "
                "may be tainted; prepare and activate a new key first"
            )
        if target.tainted:
            raise AuthorityCommandError(f"JWT key {target.kid} is already tainted")
        keys = [replace(k, tainted=True) if k is target else k for k in self.keys]
        return self._with(keys, JwtEvent(now, "tainted", target.kid, "operator"))

    def revoke(self, kid: str, now: datetime) -> JwtKeyState:
        target = self.find(kid)
        if not target.tainted:
            raise AuthorityCommandError(
                f"JWT key {target.kid} is not tainted: revoke unpublishes a key at once, so it "
                "is only allowed after `meshca authority taint --jwt` (agents then drop the "
                "tokens it signed and fetch new ones)"
            )
        keys = [k for k in self.keys if k is not target]
        return self._with(keys, JwtEvent(now, "revoked", target.kid, "operator"))

    def drop(self, key: JwtKey, now: datetime, reason: str) -> JwtKeyState:
        keys = [k for k in self.keys if k is not key]
        return self._with(keys, JwtEvent(now, "dropped", key.kid, reason))

    def noted(self, event: JwtEvent) -> JwtKeyState:
        """The same keys with one more history event (the gate's `activation-gated`)."""
        return self._with(list(self.keys), event)

    def gate_waiting(self) -> JwtEvent | None:
        """The gate's waiting event for the prepared key, while its activation is held."""
        prepared = self.prepared
        if prepared is None:
            return None
        for event in reversed(self.history):
            if event.kid == prepared.kid:
                return event if event.event == GATE_WAITING else None
        return None


def no_reports(kid: str) -> AgentCoverage:
    """The coverage where no agent reports (nothing known to be stranded: covered)."""
    return AgentCoverage(0, 0)


def scheduled_step(
    state: JwtKeyState,
    policy: JwtKeyPolicy,
    now: datetime,
    new_key: Callable[[], JwtKey],
    coverage_of: Callable[[str], AgentCoverage] = no_reports,
) -> JwtKeyState | None:
    """The next automatic change due at `now`, or `None` (one step per call; the driver calls
    again while something changes). An old key leaves once expired (else only by revoke); an
    active key that can no longer sign is replaced at once; otherwise the active one is
    succeeded at half its life (prepare) and five sixths (activate, once published for the
    JWKS cache lifetime and covered: the module docstring). `coverage_of` is asked only when
    a gated activation is due."""
    for old in state.old:
        if now >= old.not_after:
            return state.drop(old, now, "expired: no token it signed is still valid")
    if not policy.automatic:
        return None
    active = state.active
    if not active.can_sign(now):
        return _replace_unusable(state, now, new_key)
    if state.prepared is None and now >= active.not_after - policy.prepare_lead:
        return state.prepare(new_key, now, "scheduled: half of the active key's life")
    prepared = state.prepared
    if prepared is not None and now >= active.not_after - policy.activate_lead:
        if not policy.published_long_enough(prepared, now):
            return None
        return _gated_activation(state, policy, now, coverage_of)
    return None


def _replace_unusable(
    state: JwtKeyState, now: datetime, new_key: Callable[[], JwtKey]
) -> JwtKeyState:
    """One step towards an active key that can sign, when the current one cannot: a prepared
    key that cannot sign either is dropped, a missing one is prepared, and the prepared one is
    activated at once (nothing can be signed while waiting for the JWKS cache or coverage)."""
    prepared = state.prepared
    expired = f"the active key {state.active.kid} expired at {state.active.not_after.isoformat()}"
    if prepared is not None and not prepared.can_sign(now):
        return state.drop(prepared, now, f"{expired} and so did this prepared key")
    if prepared is None:
        return state.prepare(new_key, now, f"{expired}: a new key at once")
    return state.activate(
        None,
        now,
        f"{expired} (the CA was down past its rotation?): activated at once, before the JWKS "
        "cache lifetime and coverage; relying parties that cached the JWKS refetch it to "
        "find the new kid",
    )


def _gated_activation(
    state: JwtKeyState,
    policy: JwtKeyPolicy,
    now: datetime,
    coverage_of: Callable[[str], AgentCoverage],
) -> JwtKeyState | None:
    """The activation at the 5/6 point: now if covered, at the gate's deadline anyway (with a
    reason that says so), else one `activation-gated` event and nothing until the next call."""
    prepared = state.prepared
    assert prepared is not None
    covered = coverage_of(prepared.kid)
    fraction = policy.activate_at_coverage
    deadline = policy.coverage_deadline(state.active)
    verdict = gate_verdict(covered, fraction, deadline, now)
    if verdict is GateVerdict.COVERED:
        reason = f"scheduled: five sixths of the active key's life; {covered.said('hold')}"
        return state.activate(None, now, reason)
    if verdict is GateVerdict.DEADLINE:
        return state.activate(
            None,
            now,
            f"{GATE_DEADLINE_REASON}: only {covered.said('hold')} (wanted {fraction:.0%}); "
            "activated anyway before the active key's tokens get too short",
        )
    if state.gate_waiting() is not None:
        return None
    reason = (
        f"waiting until {fraction:.0%} of the agents holding a JWT bundle hold it (now "
        f"{covered.said('hold')}); activates anyway at {deadline.isoformat()}"
    )
    return state.noted(JwtEvent(now, GATE_WAITING, prepared.kid, reason))
