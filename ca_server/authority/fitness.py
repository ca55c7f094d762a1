"""Whether an authority can serve the mesh: what `meshca authority prepare|activate` refuse, and
what makes a running CA not ready.

An authority is fit to sign at `now` when it is already valid, not yet expired, and will stay
valid for at least the longest workload certificate the CA grants: otherwise every leaf it signs
is cut short (`ca_server.ttl` clamps a leaf to its issuer's expiry) and, once it expires, the CA
has nothing valid to sign with while every handshake fails. A new authority whose whole lifetime
is shorter than that longest leaf can never be fit, so `prepare` refuses it up front.

The command cannot see the CA's flags, so "the longest leaf" is reckoned the way the CA reckons
it (`rotation.cap_leaf_lifetimes`), from what it can see: the smaller of the maximum workload TTL
the operator states (`--max-workload-cert-ttl`, default the CA's default) and the rotation cap
for the active authority's lifetime (a sixth of it, at most the default activation lead). When a
CA runs with a lower cap than that, the figure is too high, and the check refuses more than it
must — the safe side; the operator then states the CA's actual maximum.

Pure: everything takes `now`; nothing here reads files or the clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from ca_server.authority.slots import (
    AuthorityCommandError,
    AuthorityState,
    Slot,
    SlotRotationPolicy,
)
from ca_server.config import TtlPolicy
from certs import SigningAuthority, format_duration

DEFAULT_MAX_WORKLOAD_TTL = TtlPolicy().maximum


def longest_leaf(state: AuthorityState, stated_maximum: timedelta | None) -> timedelta:
    """The longest workload certificate a CA following `state` may grant (see the module)."""
    rotation_cap = SlotRotationPolicy(lifetime=state.active.lifetime).max_leaf_ttl
    stated = DEFAULT_MAX_WORKLOAD_TTL if stated_maximum is None else stated_maximum
    longest = min(stated, rotation_cap)
    return timedelta(seconds=round(longest.total_seconds()))  # what the messages print


def refuse_short_lifetime(lifetime: timedelta, longest: timedelta) -> None:
    """`prepare`: a new authority must outlive the longest leaf it will sign."""
    if lifetime < longest:
        raise AuthorityCommandError(
            f"a lifetime of {format_duration(lifetime)} is shorter than the longest workload "
            f"certificate the CA grants ({format_duration(longest)}): its leaves would be cut "
            "short and it would expire before it could be rotated; give a longer --root-ttl (or "
            "state the CA's actual --max-workload-cert-ttl)"
        )


def refuse_unfit(slot: Slot, now: datetime, longest: timedelta) -> None:
    """`activate`: the authority must be valid now and for at least `longest` more."""
    if now < slot.not_before:
        raise AuthorityCommandError(
            f"authority {slot.id} is not valid until {slot.not_before.isoformat()}: every "
            "workload would reject what it signs; check the clock of the host that prepared it, "
            "or prepare a new one"
        )
    if now >= slot.not_after:
        raise AuthorityCommandError(
            f"authority {slot.id} expired at {slot.not_after.isoformat()}: every handshake would "
            "fail; prepare a new one (`meshca authority prepare`) and activate that"
        )
    left = slot.not_after - now
    if left < longest:
        raise AuthorityCommandError(
            f"authority {slot.id} expires in {format_duration(left)} "
            f"({slot.not_after.isoformat()}), sooner than the longest workload certificate the "
            f"CA grants ({format_duration(longest)}): prepare a longer-lived one "
            "(`meshca authority prepare --root-ttl ...`) and activate that"
        )


def chain_problem(authority: SigningAuthority, now: datetime) -> str | None:
    """Why the CA cannot sign anything valid at `now` with `authority` (its certificate or an
    intermediate expired or not yet valid, or the root it chains to expired), else `None`."""
    for cert in (authority.cert, *authority.intermediates):
        subject = cert.subject.rfc4514_string()
        if now < cert.not_valid_before_utc:
            return (
                f"the signing chain is not valid yet: {subject} is valid from "
                f"{cert.not_valid_before_utc.isoformat()} (check the clock)"
            )
        if now >= cert.not_valid_after_utc:
            return (
                f"the signing chain has expired: {subject} expired at "
                f"{cert.not_valid_after_utc.isoformat()}; rotate the CA (docs/rotate-the-ca.md)"
            )
    if now >= authority.not_after:
        return (
            f"the signing chain has expired: its root expired at "
            f"{authority.not_after.isoformat()}; rotate the CA (docs/rotate-the-ca.md)"
        )
    return None
