"""How long a Pod Certificate lives and when the kubelet should refresh it: pure rules.

The API server accepts an `Issued` status only when `notBefore` is within 5 minutes of its
clock, `notAfter - notBefore` is at least 1 h and at most the request's `maxExpirationSeconds`,
both equal the leaf's (whole seconds), and `beginRefreshAt` lies in [notBefore + 10 min,
notAfter - 10 min]. Within those bounds the CA's own policy decides: the lifetime is the CA's
default workload TTL (clamped to its maximum, which under self-signed rotation is capped so no
leaf outlives its authority's activation lead), lowered to `maxExpirationSeconds`; the
backdate for clock skew counts inside the lifetime, so the bound holds exactly.

`beginRefreshAt` is half-way through the lifetime (the agent's default grace ratio), but never
later than the active authority's planned handover (self-signed: when its successor is due to
activate): a refresh requested then gets a leaf from the new authority, so pods move to the new
root at the rotation rather than up to half a lifetime after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from ca_server.config import TtlPolicy
from certs import CLOCK_SKEW_BACKDATE

MIN_LIFETIME = timedelta(hours=1)
REFRESH_MARGIN = timedelta(minutes=10)


class LifetimeError(ValueError):
    """No lifetime the API server accepts fits the CA's policy or its authority."""


@dataclass(frozen=True)
class PodCertificateTimes:
    not_before: datetime
    not_after: datetime
    begin_refresh_at: datetime

    @property
    def lifetime(self) -> timedelta:
        return self.not_after - self.not_before


def certificate_times(
    now: datetime,
    max_expiration_seconds: int,
    policy: TtlPolicy,
    authority_not_after: datetime,
    planned_handover: datetime | None,
) -> PodCertificateTimes:
    """The leaf's validity and its refresh point; `LifetimeError` when none fits."""
    not_before = (now - CLOCK_SKEW_BACKDATE).replace(microsecond=0)
    lifetime = min(policy.default, timedelta(seconds=max_expiration_seconds))
    lifetime = max(lifetime, policy.minimum, MIN_LIFETIME)
    if lifetime > timedelta(seconds=max_expiration_seconds):
        raise LifetimeError(
            f"spec.maxExpirationSeconds {max_expiration_seconds} is below the CA's minimum "
            f"workload lifetime ({policy.minimum})"
        )
    if lifetime > policy.maximum:
        raise LifetimeError(
            f"the CA's maximum workload lifetime ({policy.maximum}) is below the 1 h a Pod "
            "Certificate must live; raise --max-workload-cert-ttl"
        )
    not_after = min(not_before + lifetime, authority_not_after.replace(microsecond=0))
    if not_after - not_before < MIN_LIFETIME:
        raise LifetimeError(
            f"the CA's signing authority expires at {authority_not_after.isoformat()}, before "
            "a Pod Certificate could live 1 h; rotate the CA"
        )
    refresh = _refresh_at(not_before, not_after, planned_handover)
    return PodCertificateTimes(not_before, not_after, refresh)


def with_not_after(
    times: PodCertificateTimes, not_after: datetime, planned_handover: datetime | None
) -> PodCertificateTimes:
    """`times` for a leaf that ended up with another `not_after` (its refresh point again)."""
    refresh = _refresh_at(times.not_before, not_after, planned_handover)
    return PodCertificateTimes(times.not_before, not_after, refresh)


def _refresh_at(
    not_before: datetime, not_after: datetime, planned_handover: datetime | None
) -> datetime:
    earliest, latest = not_before + REFRESH_MARGIN, not_after - REFRESH_MARGIN
    at = not_before + (not_after - not_before) / 2
    if planned_handover is not None and planned_handover > not_before:
        at = min(at, planned_handover)
    return min(max(at, earliest), latest).replace(microsecond=0)
