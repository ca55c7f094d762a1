"""The JWT-SVID signing keys as slots — the X.509 authority's phases, for a key with no certificate.

Each key sits in the same phases as an X.509 authority (`ca_server.authority.Phase`): `prepared`
(published in the JWT bundle and the discovery JWKS, not signing), `active` (the one key that
signs), `old` (no longer signing, still published so the tokens it signed verify until they
expire), and an `old` key may be `tainted` (agents drop the tokens it signed) and then revoked
(unpublished at once). The same operator rules hold: only a prepared key activates, only an old
one is tainted, only a tainted one is revoked.

Activation has one more rule than the X.509 root's, because relying parties outside the mesh
cache the JWKS and no agent report can see them: a prepared key activates only once it has been
published for `jwks_max_age` (the `Cache-Control: max-age` the discovery endpoint advertises),
as well as at the clock's 5/6 point and, with `--activate-at-coverage`, once that share of the
reporting agents hold it (`ca_server.authority`'s gate rules).

Pure: `now` is passed in; nothing here reads files or clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from ca_server.authority import AuthorityCommandError, Phase
from certs import PrivateKey
from certs.jwk import jwk_thumbprint, key_algorithm, public_jwk

HISTORY_LIMIT = 50
KID_PREFIX_MIN = 8


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

    def jwk(self) -> dict[str, str]:
        return public_jwk(self.key)


@dataclass(frozen=True)
class JwtEvent:
    at: datetime
    event: str  # prepared | activated | retired | dropped | tainted | revoked
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

    def __post_init__(self) -> None:
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


def scheduled_step(
    state: JwtKeyState,
    policy: JwtKeyPolicy,
    now: datetime,
    new_key: Callable[[], JwtKey],
    covered: Callable[[str], bool] = lambda kid: True,
) -> JwtKeyState | None:
    """The next automatic change due at `now`, or `None`. An old key is dropped once no token
    it signed can still be valid; the active one is succeeded at half its life (prepare) and
    five sixths (activate, once published for the JWKS cache lifetime and `covered`)."""
    for old in state.old:
        retired = old.retired_at or now
        if now >= min(old.not_after, retired + policy.max_token_ttl + policy.convergence):
            return state.drop(old, now, "its last token has expired")
    if not policy.automatic:
        return None
    active = state.active
    if state.prepared is None and now >= active.not_after - policy.prepare_lead:
        return state.prepare(new_key, now, "scheduled: half of the active key's life")
    prepared = state.prepared
    if prepared is not None and now >= active.not_after - policy.activate_lead:
        if not policy.published_long_enough(prepared, now):
            return None
        # The coverage gate gives way before the active key is too short to sign a whole token.
        if not covered(prepared.kid) and now < active.not_after - 2 * policy.max_token_ttl:
            return None
        return state.activate(None, now, "scheduled: five sixths of the active key's life")
    return None
