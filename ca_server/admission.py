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
certificate and still saw only a handful of requests at a time. On the completion-queue server
(`ca_server.serving.cq_server`) a handler starts as soon as its request is read, whatever the
loop's backlog, so a request that goes to the loop for any wait, however short, is counted
while it then waits for the loop's CPU: what should not count (a new development token, a
cached review) must finish inline (`ca_server.jwt_authn.JwksFile` answers from a set read less
than a second ago for that reason).

Concurrency: handlers run on the completion-queue thread or on the event loop
(`ca_server.serving.cq_server`), so admitting and releasing take a lock (held for arithmetic
only).
"""

from __future__ import annotations

import bisect
import math
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
# Clients refused are booked by the time they were told to come back, at this resolution.
_RETURN_SLOT = 0.25


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
        # The queue outside the CA: clients refused, booked by the time they were told to come
        # back (in `_RETURN_SLOT` slots), until that time.
        self._returns: dict[int, int] = {}  # slot -> clients due back in it
        self._return_slots: list[int] = []  # the slots booked, in order
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
            hint_ms = self._hint_ms(renewal)
            self._sent_away(hint_ms)
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
                retry_after_ms=self._hint_ms(renewal=True),
            )
        self._reports_in_flight += 1
        return Ticket(self, report=True)

    def retry_hint_ms(self, *, renewal: bool) -> int:
        """When a client refused now gets its turn, at the rate requests have been completing:
        after the requests in flight and the clients already told to come back before it
        (four times that for renewals), within [50 ms, 30 s]. Without the latter, 10,000
        waiting pods would each be told "a few seconds" and return in a flood of refusals.

        Why a rate and not a per-request time: what bounds the drain differs by request (the
        API server's review budget for a new token, the CPU for a cached one), and a mix of
        both makes any per-request average meaningless; completions per second are what the
        clients waiting actually get.

        Why every client refused is booked at the time it was told (`_sent_away`) rather than
        the clients away estimated from the refusal rate times the hints: in a storm's first
        second the same clients are refused several times over while the hints are still
        short, so a rate counted each of them several times, and more the faster the server
        answers a refusal (the completion-queue server several times faster than grpc.aio's).
        The estimate ran to five times the clients there were; everyone was told the whole
        queue's time (30 s), they came back together long after the CA had drained, and met a
        full CA again. Booked, each client is told its own turn: returns are spread at the
        rate the CA completes requests."""
        with self._lock:
            return self._hint_ms(renewal)

    def _hint_ms(self, renewal: bool) -> int:
        rate = self._rate or 1 / _INITIAL_SERVICE_TIME
        now = self._monotonic()
        self._forget_returned(now)
        per_client = (_RENEWAL_HINT_FACTOR if renewal else 1) / rate
        ahead = self._in_flight
        wait = ahead * per_client
        # The clients booked no later than its turn go first (and push the turn further).
        # At most one pass over the slots, ~30 s / `_RETURN_SLOT` of them in a long storm.
        returns, cap = self._returns, _MAX_HINT_MS / 1000
        for slot in self._return_slots:
            if slot * _RETURN_SLOT > now + wait or wait >= cap:
                break
            ahead += returns[slot]
            wait = ahead * per_client
        return int(min(_MAX_HINT_MS, max(_MIN_HINT_MS, wait * 1000)))

    def _sent_away(self, hint_ms: int) -> None:
        """Books a client refused with `hint_ms` at the time it may come back."""
        slot = math.floor((self._monotonic() + hint_ms / 1000) / _RETURN_SLOT)
        if slot not in self._returns:
            bisect.insort(self._return_slots, slot)
            self._returns[slot] = 0
        self._returns[slot] += 1

    def _forget_returned(self, now: float) -> None:
        """Drops the bookings that are due: those clients are back (admitted, or booked again)."""
        current = math.floor(now / _RETURN_SLOT)
        slots = self._return_slots
        while slots and slots[0] < current:
            del self._returns[slots.pop(0)]

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
            self._window_busy, self._busy_since, self._window_completions = 0.0, now, 0
