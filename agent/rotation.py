"""When is a certificate due, and how long to wait after a failure: the pure rotation policy.

The scheduler (`agent.scheduler`) only acts; every decision about time is made here, from
values handed in (`now`, a random source), so it can be tested without a loop or a clock.

- Rotation point: `expire - ratio * (expire - received)`, ratio = `grace_period_ratio ± U·jitter`
  (Istio's SECRET_GRACE_PERIOD_RATIO, see docs), measured from when the certificate was received
  rather than from its NotBefore, which the CA backdates by two minutes for clock skew. The
  jitter spreads the renewals of agents (or identities) that started together.
- Retry: exponential backoff with jitter (`agent.backoff`), never scheduled past the current
  certificate's expiry, so the last retry happens while the workload still has a valid one.
- Taint: a leaf whose authority the CA has tainted is re-signed at a uniform point of
  `taint_resign_window` counted from the taint (`taint_resign_delay`), or at its normal
  rotation point if that comes first.
- Key + CSR: a fresh key for every attempt, never reused across rotations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from agent.backoff import Backoff
from certs import KeySpec, PrivateKey, SpiffeId, build_csr, generate_private_key

SINGLE_IDENTITY_BACKOFF = Backoff(initial=0.5, multiplier=2.0, maximum=30.0, jitter=0.5)
"""Retries of the pod agent's one certificate: 0.5 s doubling to 30 s."""

NODE_BACKOFF = Backoff(initial=0.5, multiplier=2.0, maximum=150.0, jitter=0.5)
"""Per-identity retries of the node agent (ztunnel's numbers): 0.5 s doubling to 150 s."""


@dataclass(frozen=True)
class RotationPolicy:
    """What the configuration says about timing; one per agent."""

    ttl: timedelta
    grace_period_ratio: float = 0.5
    grace_period_ratio_jitter: float = 0.01
    backoff: Backoff = SINGLE_IDENTITY_BACKOFF
    taint_resign_window: timedelta = timedelta(minutes=5)

    def renewal_delay(
        self, not_after: datetime, received_at: datetime, now: datetime, rng: random.Random
    ) -> float:
        """Seconds from `now` until a certificate received at `received_at` is due (jittered)."""
        ratio = jittered_ratio(self.grace_period_ratio, self.grace_period_ratio_jitter, rng)
        return rotation_delay(not_after, received_at, now, ratio)

    def taint_resign_delay(self, seconds_since_taint: float, rng: random.Random) -> float:
        """Seconds from now until a leaf of an authority tainted `seconds_since_taint` ago is
        re-signed: a uniform point in the window counted from the taint (not from when this
        agent heard of it), so every identity of every agent picks its own moment and the
        CA's CSR rate after a taint stays near (identities / window). A point already past —
        the agent learnt late — is now; since agents learn at their own jittered report
        times, those late ones stay spread too."""
        window = self.taint_resign_window.total_seconds()
        return max(0.0, rng.uniform(0.0, window) - max(0.0, seconds_since_taint))

    def retry_delay(
        self, attempt: int, now: datetime, expires: datetime | None, rng: random.Random
    ) -> float:
        """Seconds before retry `attempt` (0-based), within the cached certificate's life."""
        return retry_delay(attempt, now, expires, rng, self.backoff)


@dataclass(frozen=True)
class FailureRecord:
    """The last failed attempt for one identity, for the status endpoint and logs."""

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
    backoff: Backoff = SINGLE_IDENTITY_BACKOFF,
) -> float:
    """Backoff before retry `attempt`, but never past `expires` while the certificate is valid,
    so the last retry happens before the workload's certificate runs out."""
    delay = backoff.delay(attempt, rng)
    if expires is not None and now < expires:
        delay = min(delay, (expires - now).total_seconds())
    return delay


def new_key_and_csr(spec: KeySpec, identity: SpiffeId) -> tuple[PrivateKey, str]:
    """A fresh private key (never reused across rotations) and a CSR for `identity`; CPU-bound,
    so callers run it in a worker thread."""
    key = generate_private_key(spec)
    return key, build_csr(key, identity)
