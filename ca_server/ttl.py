"""How long a workload certificate lives: Istio's defaults, clamped rather than refused."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from ca_server.config import TtlPolicy
from ca_server.errors import CaUnavailableError
from certs import CLOCK_SKEW_BACKDATE

# `validity_duration` is an int64; `timedelta` overflows past ~2.7 million years. Clamping here
# keeps a silly request an ordinary "above the maximum" instead of an internal error.
_LONGEST_REQUEST_SECONDS = int(timedelta(days=999_999).total_seconds())


@dataclass(frozen=True)
class Validity:
    not_before: datetime
    not_after: datetime
    requested: timedelta | None
    clamped_by: str | None  # "maximum", "minimum", "ca-expiry" or None

    @property
    def granted(self) -> timedelta:
        """The lifetime from now (not from the backdated NotBefore) the caller actually gets."""
        return self.not_after - (self.not_before + CLOCK_SKEW_BACKDATE)


def grant_validity(
    requested_seconds: int, policy: TtlPolicy, *, ca_not_after: datetime, now: datetime
) -> Validity:
    """NotBefore = now - 2 min; NotAfter = now + TTL, clamped to the policy and the CA's expiry.

    `requested_seconds <= 0` asks for the default. A CA that has already expired cannot issue.
    Any int64 is accepted: values beyond what `timedelta` can hold are clamped like any other
    request above the maximum.
    """
    requested = (
        timedelta(seconds=min(requested_seconds, _LONGEST_REQUEST_SECONDS))
        if requested_seconds > 0
        else None
    )
    ttl = requested or policy.default
    clamped_by: str | None = None
    if ttl > policy.maximum:
        ttl, clamped_by = policy.maximum, "maximum"
    elif ttl < policy.minimum:
        ttl, clamped_by = policy.minimum, "minimum"
    not_after = now + ttl
    if not_after > ca_not_after:
        not_after, clamped_by = ca_not_after, "ca-expiry"
    if not_after <= now:
        raise CaUnavailableError(
            "ca-expired",
            "the CA's signing certificate has expired; rotate the CA (see docs) before issuing",
        )
    return Validity(now - CLOCK_SKEW_BACKDATE, not_after, requested, clamped_by)
