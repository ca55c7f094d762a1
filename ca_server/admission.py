"""Admission control: a bounded number of requests in flight per CA process.

Why: when a node scales up, thousands of pods ask for their first certificate at once. Queueing
them all makes every request slow, and the slowest run into their deadlines (the failure mode
reported for Istio, istio-csr and Linkerd). Refusing the excess at once with `UNAVAILABLE` and
a retry hint (`grpc-retry-pushback-ms`, gRPC's retry pushback trailer) keeps the latency of the
admitted requests low and tells the others when to come back.

First certificates before renewals: a renewal (request header `x-meshca-renewal: 1`, sent by
meshca agents that still hold a valid certificate) is admitted only while fewer than
`max_in_flight_renewals` requests are in flight; anything else (including Istio's agents, which
do not say) counts as a first certificate and may use all `max_in_flight` slots. So a renewal
storm is shed first and can never starve pods that have no certificate yet.

"In flight" counts requests from the moment their handler starts until it returns, so it is the
number of requests waiting *inside* the CA: for the API server (TokenReview, node authorizer
lookups), a JWKS fetch, or the CPU after such a wait. That is where a cluster's storm piles up.
A purely CPU-bound backlog (dev tokens, cached reviews) waits in gRPC's core before Python sees
it and is not counted; it is bounded by the clients' own concurrency and drained at full speed
by the workers (`bench/storm.py` measures both cases). Counting it would need a hook gRPC's
asyncio server does not offer; yielding once per request to let it surface cost ~3 % per
certificate and still saw only a handful of requests at a time.

Concurrency: handlers run on the completion-queue thread or on the event loop
(`ca_server.serving.cq_server`), so admitting and releasing take a lock (held for arithmetic
only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ca_server.config import AdmissionPolicy
from ca_server.errors import OverloadedError
from ca_server.wire import RENEWAL_HEADER, RETRY_PUSHBACK_TRAILER

# Bounds of the retry hint: come back no sooner than this (a retry storm of its own otherwise),
# and no later (so a client never idles long after the queue has drained).
_MIN_HINT_MS = 50
_MAX_HINT_MS = 30_000
# Renewals have hours of certificate life left: tell them to wait longer than first requests.
_RENEWAL_HINT_FACTOR = 4
# The completion rate is measured over windows of this much busy time (time with requests in
# flight; idle time says nothing about how fast the CA drains), smoothed across windows.
_RATE_WINDOW = 0.5
_RATE_WEIGHT = 0.3
# Before the first window closes: assume a request takes this long (a cached-token issuance).
_INITIAL_SERVICE_TIME = 0.002


def is_renewal(metadata: Iterable[tuple[str, str | bytes]]) -> bool:
    """Only an explicit `x-meshca-renewal: 1` (or `true`) makes a request a renewal (gRPC
    metadata keys arrive lower-cased)."""
    return any(
        key == RENEWAL_HEADER and isinstance(value, str) and value.strip().lower() in ("1", "true")
        for key, value in metadata
    )


@dataclass
class Ticket:
    """One admitted request; `release()` when its handler ends (exactly once)."""

    admission: Admission
    report: bool = False
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)


class Admission:
    def __init__(self, policy: AdmissionPolicy, monotonic: Callable[[], float]) -> None:
        self._policy = policy
        self._monotonic = monotonic
        self._in_flight = 0  # certificate requests
        self._reports_in_flight = 0
        self._rate: float | None = None  # completions per second of busy time
        self._busy_since = 0.0  # start of the current busy stretch (valid while in flight)
        self._window_busy = 0.0  # busy time in the current window, before `_busy_since`
        self._window_completions = 0
        # Clients told to come back later, estimated (Little's law) from the refusals of the
        # last windows times the mean wait they were told: the queue outside the CA.
        self._waiting = 0.0
        self._window_refusals = 0
        self._window_hinted = 0.0  # seconds of retry hint handed out in this window
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Certificate requests in flight (reports are `reports_in_flight`)."""
        return self._in_flight

    @property
    def reports_in_flight(self) -> int:
        return self._reports_in_flight

    def admit(self, *, renewal: bool) -> Ticket:
        """A ticket, or `OverloadedError` (with a retry hint) when this request must wait."""
        with self._lock:
            return self._admit(renewal)

    def _admit(self, renewal: bool) -> Ticket:
        limit = self._policy.max_in_flight_renewals if renewal else self._policy.max_in_flight
        if self._in_flight >= limit:
            hint_ms = self.retry_hint_ms(renewal=renewal)
            self._window_refusals += 1
            self._window_hinted += hint_ms / 1000
            raise OverloadedError(
                "overloaded-renewal" if renewal else "overloaded",
                f"the CA is busy ({self._in_flight} requests in flight, limit {limit} for "
                f"{'renewals' if renewal else 'first certificates'}); retry after the "
                f"{RETRY_PUSHBACK_TRAILER} hint",
                retry_after_ms=hint_ms,
            )
        if self._in_flight == 0:
            self._busy_since = self._monotonic()
        self._in_flight += 1
        return Ticket(self)

    def admit_report(self) -> Ticket:
        """A ticket for an agent report, or `OverloadedError` when anything else is asked of
        this CA: only while fewer than `reports_limit` requests (certificates and reports) are
        in flight. Its hint is a renewal's (the agent reports again next period anyway; another
        client learns when the queue should have drained)."""
        with self._lock:
            return self._admit_report()

    def _admit_report(self) -> Ticket:
        busy = self._in_flight + self._reports_in_flight
        limit = self._policy.reports_limit
        if busy >= limit:
            raise OverloadedError(
                "overloaded-report",
                f"the CA is busy ({busy} requests in flight, limit {limit} for agent reports, "
                "which come after every certificate request); report again next period or "
                f"after the {RETRY_PUSHBACK_TRAILER} hint",
                retry_after_ms=self.retry_hint_ms(renewal=True),
            )
        self._reports_in_flight += 1
        return Ticket(self, report=True)

    def retry_hint_ms(self, *, renewal: bool) -> int:
        """About the time the queue needs to drain at the rate requests have been completing
        (longer for renewals), within [50 ms, 30 s]. The queue is the requests in flight plus
        the clients already told to come back: with only the former, 10,000 waiting pods
        would each be told "a few seconds" and return in a flood of refusals.

        Why a rate and not a per-request time: what bounds the drain differs by request (the
        API server's review budget for a new token, the CPU for a cached one), and a mix of
        both makes any per-request average meaningless; completions per second are what the
        clients waiting actually get.

        The clients away are at least those refused in the current window: the smoothed
        estimate learns of them only when the window closes, and in a storm's first window (no
        estimate yet) every client refused would otherwise be told the same floor-length wait
        and be back, refused again, within it. How often that happens depends on how fast the
        server answers a refusal (the completion-queue server several times faster than
        grpc.aio's), so without this the number of refusals in a storm did too."""
        rate = self._rate or 1 / _INITIAL_SERVICE_TIME
        waiting = max(self._waiting, self._window_refusals)
        drain_ms = (self._in_flight + waiting) / rate * 1000
        if renewal:
            drain_ms *= _RENEWAL_HINT_FACTOR
        return int(min(_MAX_HINT_MS, max(_MIN_HINT_MS, drain_ms)))

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self._release_locked(ticket)

    def _release_locked(self, ticket: Ticket) -> None:
        if ticket.report:  # not part of the certificate queue the hints describe
            self._reports_in_flight -= 1
            return
        now = self._monotonic()
        self._in_flight -= 1
        self._window_completions += 1
        busy = self._window_busy + (now - self._busy_since)
        if self._in_flight == 0:  # a busy stretch ends: keep its time, not the idle after it
            self._window_busy, self._busy_since = busy, now
        if busy >= _RATE_WINDOW:
            observed = self._window_completions / busy
            self._rate = (
                observed
                if self._rate is None
                else self._rate + _RATE_WEIGHT * (observed - self._rate)
            )
            # Little's law: clients away = refusals per second x mean time away. Clients wait
            # the hint times U[1, 1.5] (meshca's agent), so 1.25 x the mean hint.
            away = (
                1.25 * self._window_hinted / self._window_refusals if self._window_refusals else 0
            )
            waiting = self._window_refusals / busy * away
            self._waiting += _RATE_WEIGHT * (waiting - self._waiting)
            self._window_busy, self._busy_since, self._window_completions = 0.0, now, 0
            self._window_refusals, self._window_hinted = 0, 0.0
