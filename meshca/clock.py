"""Time, injected: every expiry and rotation decision asks a `Clock`, never `datetime.now()`.

`SystemClock` is the real one. `FakeClock` lets tests move time forward; coroutines sleeping on it
wake when the fake time passes their deadline, so rotation can be tested without waiting.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware UTC."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Waits `seconds` of this clock's time."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps back, for measuring durations (latency)."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock tests drive by hand with `advance()`; sleepers wake as their deadline passes."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2030, 1, 1, tzinfo=UTC)
        self._sleepers: list[tuple[datetime, asyncio.Future[None]]] = []
        self._start = self._now

    def now(self) -> datetime:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._now + timedelta(seconds=seconds), future))
        try:
            await future
        finally:
            self._sleepers = [(d, f) for d, f in self._sleepers if f is not future]

    @property
    def sleepers(self) -> int:
        """How many coroutines are sleeping on this clock now: a test advances the clock once
        the loop it drives is asleep, so the advance cannot fall between that loop's choosing
        a deadline and its going to sleep on it (where it would wake only at the next one)."""
        return sum(1 for _, future in self._sleepers if not future.done())

    def monotonic(self) -> float:
        """Seconds of fake time since the clock was made: moves only with `advance()`."""
        return (self._now - self._start).total_seconds()

    def advance(self, delta: timedelta | float) -> None:
        self._now += delta if isinstance(delta, timedelta) else timedelta(seconds=delta)
        for deadline, future in list(self._sleepers):
            if deadline <= self._now and not future.done():
                future.set_result(None)
