"""A token bucket for calls the CA makes on behalf of requests (TokenReview).

The python `kubernetes` client has no client-side limiter (client-go's QPS/Burst), so a burst of
workloads starting at once would become the same burst at the API server. The bucket turns it
into at most `burst` immediate calls followed by `rate` per second.

Requests that may simply be refused (agent reports: advisory, reported again next period) take
only a spare token (`take_spare`): one that leaves at least half the burst in the bucket, taken
at once or not at all. They never reserve a future slot, so a certificate request never waits
behind them, and a certificate storm right after a report storm still finds half the burst.

Concurrency: `acquire` reserves a slot synchronously and then sleeps until the slot's time, so
waiters are served in order; it sleeps on the event loop (the TokenReview authenticator moves a
handler there before it reviews, `loop_handoff.to_the_loop`). Reserving takes a lock, so the
bucket stays exact whichever thread a caller runs on.
"""

from __future__ import annotations

import threading

from meshca.clock import Clock


class AsyncTokenBucket:
    def __init__(self, rate: float, burst: int, clock: Clock) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"token bucket needs rate > 0 and burst >= 1 (got {rate}, {burst})")
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._updated = clock.monotonic()
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Takes one token; returns how many seconds the caller must wait before using it."""
        with self._lock:
            now = self._clock.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._updated) * self._rate)
            self._updated = now
            self._tokens -= 1
            return 0.0 if self._tokens >= 0 else -self._tokens / self._rate

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            await self._clock.sleep(delay)

    def take_spare(self) -> float:
        """Takes one token if the bucket still holds half its burst (rounded down) after it;
        returns 0 then. Otherwise takes nothing and returns the seconds until a token would be
        spare (a retry hint)."""
        with self._lock:
            now = self._clock.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._updated) * self._rate)
            self._updated = now
            floor = float(int(self._burst) // 2)
            if self._tokens - 1 >= floor:
                self._tokens -= 1
                return 0.0
            return (floor + 1 - self._tokens) / self._rate
