"""Is the event loop still turning? A heartbeat the status thread can read.

The status HTTP server runs on its own thread so a slow scrape never stalls the loop; the flip
side is that it keeps answering "ready" while the loop itself is stuck (a blocking `open()` on a
FIFO, a runaway computation), and the kubelet keeps routing to a pod whose SDS no longer
answers. `LoopHeartbeat.run()` stamps the time every `interval` seconds on the loop;
`stalled_for()` (any thread) reports how long the loop has been silent once that exceeds
`stale_after`.

This measures the real loop on the real monotonic clock on purpose: a fake `Clock` that moves
time would make a healthy loop look stuck, or a stuck one healthy.

Concurrency: `run` on the loop; `stalled_for` from any thread (a float read and written whole).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_INTERVAL = 1.0
DEFAULT_STALE_AFTER = 5.0


class LoopHeartbeat:
    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL,
        stale_after: float = DEFAULT_STALE_AFTER,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if stale_after <= interval:
            raise ValueError("stale_after must be longer than the heartbeat interval")
        self.interval = interval
        self.stale_after = stale_after
        self._monotonic = monotonic
        self._last: float | None = None

    async def run(self) -> None:
        """Stamps the time until cancelled."""
        while True:
            self._last = self._monotonic()
            await asyncio.sleep(self.interval)

    def stalled_for(self) -> float | None:
        """Seconds since the last beat when that is longer than `stale_after`, else `None`
        (also before the first beat: not started is not stuck)."""
        last = self._last
        if last is None:
            return None
        silent = self._monotonic() - last
        return silent if silent > self.stale_after else None
