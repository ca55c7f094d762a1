"""Per-request bookkeeping so tests can assert on API traffic ("no second TokenReview")."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass
class RequestRecord:
    """One API request. ``code`` is filled in once the response status is known."""

    method: str
    path: str
    verb: str
    resource: str
    namespace: str | None = None
    name: str | None = None
    code: int | None = None
    # The client's User-Agent: tells apart several clients (e.g. CA replicas) of one server.
    user_agent: str | None = None


class RequestRecorder:
    """Counts requests by (verb, resource); recorded *before* the response is sent.

    Recording first means a test that has just received a response can rely on the counter
    already including that request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[RequestRecord] = []
        self._counts: Counter[tuple[str, str]] = Counter()

    def record(self, record: RequestRecord) -> RequestRecord:
        with self._lock:
            self._records.append(record)
            self._counts[(record.verb, record.resource)] += 1
        return record

    def count(self, verb: str | None = None, resource: str | None = None) -> int:
        """Requests matching ``verb`` and ``resource`` (``None`` matches anything)."""
        with self._lock:
            return sum(
                n
                for (v, r), n in self._counts.items()
                if (verb is None or v == verb) and (resource is None or r == resource)
            )

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def records(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def reset(self) -> None:
        with self._lock:
            self._records.clear()
            self._counts.clear()
