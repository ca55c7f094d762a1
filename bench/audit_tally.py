"""API requests of one account, counted from the real API server's audit log (Metadata level,
`tests.support.real_kube`), for the benchmarks: what the CA asked of the server, and when.

Why the audit log and not the CA's metrics: it is the server's own record, the same before and
after a change to the CA. One request is one `auditID` (a watch writes two events, at
ResponseStarted and ResponseComplete; counted once, at the time it was received). A paginated
list is one LIST request per page: pages that carry `continue=` are counted apart from list
*starts*, so "one pod list per replica" can be read off whatever the page size.

`AuditLog` reads the file incrementally (it grows by the CA's watches and TokenReviews for the
whole run) and keeps one small record per request.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class Request:
    username: str
    # "list pods", "list pods (continue)", "watch pods", "watch pods (initial state)" (a
    # watch-list: the state streamed, then a bookmark), "create tokenreviews", ...
    kind: str
    received: float  # seconds since the epoch


def request_kind(event: Mapping[str, object]) -> str:
    """`verb resource[/subresource]` of an audit event, or `verb /path` for a non-resource
    URL; a list page that continues an earlier one gets ` (continue)`."""
    verb = str(event.get("verb", "?"))
    uri = str(event.get("requestURI", ""))
    ref = event.get("objectRef")
    if isinstance(ref, dict):
        resource = str(ref.get("resource", "?"))
        if ref.get("subresource"):
            resource += f"/{ref['subresource']}"
    else:
        resource = uri.split("?")[0]
    query = uri.partition("?")[2]
    params = query.split("&")
    continued = verb == "list" and any(p.startswith("continue=") for p in params)
    streamed = verb == "watch" and "sendInitialEvents=true" in params
    suffix = " (continue)" if continued else " (initial state)" if streamed else ""
    return f"{verb} {resource}{suffix}"


def _timestamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class AuditLog:
    """The requests in an audit log file so far; `refresh()` reads what was appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self._seen: set[str] = set()
        self.requests: list[Request] = []

    def refresh(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as stream:
            stream.seek(self._offset)
            data = self._partial + stream.read()
            self._offset = stream.tell()
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an event still being written
        for line in lines:
            if line.strip():
                self._add(json.loads(line))

    def _add(self, event: Mapping[str, object]) -> None:
        audit_id = str(event.get("auditID"))
        if audit_id in self._seen:
            return
        self._seen.add(audit_id)
        user = event.get("user")
        username = str(user.get("username", "")) if isinstance(user, dict) else ""
        received = _timestamp(str(event.get("requestReceivedTimestamp")))
        self.requests.append(Request(username, request_kind(event), received))

    def tally(self, username: str, since: float = 0.0, until: float = float("inf")) -> Counter[str]:
        """Requests of `username` received in [since, until), by kind."""
        self.refresh()
        return Counter(
            r.kind for r in self.requests if r.username == username and since <= r.received < until
        )


def describe(tally: Mapping[str, int], kinds: Iterable[str] | None = None) -> str:
    """`list pods 1, watch pods 1, ...` (every kind, or `kinds` in that order, zeros shown)."""
    chosen = list(kinds) if kinds is not None else sorted(tally)
    return ", ".join(f"{kind} {tally.get(kind, 0)}" for kind in chosen) or "none"
