"""Exponential backoff with jitter, shared by the CA client (short in-call retries) and the
secret manager (long-running renewal retries). Pure: the caller supplies the random source and
does the sleeping, so tests can check the bounds exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delay before retry number `attempt` (0-based): `initial * multiplier^attempt`, capped at
    `maximum`, then scaled by a uniform factor in [1 - jitter, 1] so that many agents failing
    together spread out instead of retrying in lockstep (and the cap is never exceeded)."""

    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 30.0
    jitter: float = 0.5

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        base = min(self.maximum, self.initial * self.multiplier ** min(attempt, 64))
        factor = (rng or random).uniform(1.0 - self.jitter, 1.0)
        return base * factor
