"""Injected faults: make the fake API server slow, failing, or cutting watches, on purpose.

A test arms a `Fault` for a verb and resource (`server.faults.add(Fault("create",
"tokenreviews", delay=0.5))`); each matching request consumes one use (`times`, or forever when
`None`) and is delayed, answered with an error status, or (for watches) cut after a number of
events. Faults apply to counted API requests only, never to `/healthz` or the admin routes.

Statuses are shaped like kube-apiserver's: 500 `InternalError`, 429 `TooManyRequests` with a
`Retry-After`, 410 `Expired` (on a watch: a 200 stream with one ERROR event, as the real server
sends for a too-old resourceVersion), 503 `ServiceUnavailable`.

Concurrency: handlers run on the server's threads; the plan is guarded by one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .errors import ApiError

_REASONS = {
    410: ("Expired", "too old resource version (injected fault)"),
    429: ("TooManyRequests", "too many requests, please try again later (injected fault)"),
    500: ("InternalError", "an error on the server has prevented the request (injected fault)"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
}


@dataclass
class Fault:
    """What to do to matching requests. `verb`/`resource` `None` match any."""

    verb: str | None = None
    resource: str | None = None
    delay: float = 0.0
    status: int | None = None
    drop_watch_after: int | None = None  # watches only: close after this many events
    times: int | None = None  # uses left; None = until removed
    hits: int = 0

    def matches(self, verb: str, resource: str) -> bool:
        return (self.verb is None or self.verb == verb) and (
            self.resource is None or self.resource == resource
        )

    def error(self) -> ApiError | None:
        if self.status is None:
            return None
        reason, message = _REASONS.get(self.status, ("InternalError", "injected fault"))
        return ApiError(self.status, reason, message)


class FaultPlan:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def take(self, verb: str, resource: str) -> Fault | None:
        """The first armed fault matching the request, with one use consumed."""
        with self._lock:
            for fault in self._faults:
                if fault.matches(verb, resource):
                    fault.hits += 1
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self._faults.remove(fault)
                    return fault
        return None
