"""Requests sent back to back through a mesh hop on a thread, every result and its time kept.

Used by the end-to-end tests that rotate something (a leaf, a CA) while requests flow: the
failures, the rate over the whole run and the worst window are what they assert and print.
"""

from __future__ import annotations

import threading
import time

from tests.support.envoy import HttpResult, http_get


class Traffic:
    """Requests sent on a thread until stopped, or until `max_requests` or `max_seconds` is
    reached; every result is kept with its (monotonic) start time.

    Back to back by default; with `per_second`, paced to that rate (a late request goes at
    once, so the rate holds on average): a loopback hop answers hundreds of requests a second,
    and a test that runs for a minute should not take the CPU from the processes it watches.
    """

    def __init__(
        self,
        url: str,
        *,
        max_requests: int = 20_000,
        max_seconds: float = 40,
        per_second: float | None = None,
    ) -> None:
        self.url = url
        self.interval = 1 / per_second if per_second else 0.0
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self.results: list[HttpResult] = []
        self.started_at: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        next_at = time.monotonic()
        while (
            not self._stop.is_set()
            and len(self.results) < self.max_requests
            and time.monotonic() < deadline
        ):
            if self.interval:
                self._stop.wait(max(next_at - time.monotonic(), 0))
                next_at += self.interval
            started = time.monotonic()
            result = http_get(self.url)
            self.started_at.append(started)
            self.results.append(result)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def failures(self) -> list[HttpResult]:
        return [result for result in self.results if not result.ok]

    def rate(self) -> float:
        """Requests per second from the first request to the last."""
        if len(self.started_at) < 2:
            return 0.0
        return (len(self.started_at) - 1) / (self.started_at[-1] - self.started_at[0])

    def slowest_window(self, seconds: float = 5.0) -> float:
        """The lowest request rate over any whole `seconds`-long window of the run: a stall
        (say, requests hanging on a handshake during a CA change) shows here, not in the mean."""
        times = self.started_at
        if not times or times[-1] - times[0] < seconds:
            return self.rate()
        lowest = float("inf")
        end = 0
        for start, opened in enumerate(times):
            if opened + seconds > times[-1]:
                break
            while end < len(times) and times[end] < opened + seconds:
                end += 1
            lowest = min(lowest, (end - start) / seconds)
        return lowest

    def summary(self) -> str:
        return (
            f"{len(self.results)} requests, {len(self.failures())} failed, "
            f"{self.rate():.1f}/s mean, {self.slowest_window():.1f}/s in the slowest 5 s"
        )
