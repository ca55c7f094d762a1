"""Which trust bundle each agent holds — the figure that says how far a new root has spread.

meshca agents send three headers on every CSR (`agent.propagation`): their run's agent id, the
canonical digest of the trust bundle they serve, and the authority of the leaf they renew; and
the same facts in a light periodic report between renewals (`ca_server.report_service`,
`AgentReports.record_periodic`), so the table stays fresh while nobody renews. The RPC edges
hand them to `AgentReports`; a malformed or over-long value is ignored (a
report is advisory, never a reason to refuse a certificate). A caller without an agent id
(Istio's agents) is recorded by its identity as *unknown*: counted apart, never as covered.

Each CA process keeps its own table (bounded: `capacity` agents, the least recently seen
evicted first; an entry expires `expire_after` — twice the maximum leaf TTL — after it was last
seen, since a live agent renews well before that) and publishes it with its leaf ledger (same
sink, same cadence). Readers merge every process's snapshot: per agent id the most recent
entry wins (by its expiry, to the millisecond, as each process's clock set it: replicas' clocks
are assumed to agree far better than an agent's renewal interval), so an agent that renewed
through two replicas counts once, with what it said last.

Coverage rule (`coverage`): a digest says nothing by itself about which roots it covers, so the
reader computes the digest of every non-empty subset of the authorities in the shared state
(there are at most a handful) and an agent trusts authority X exactly when its digest is that of
a subset containing X. An agent whose digest matches no subset (a bundle holding roots the CA
no longer knows, or none yet) is *reporting* and trusts none of them: it is never counted as
covered by guesswork.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509

from certs.bundle import bundle_digest
from meshca.report_headers import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER

log = logging.getLogger(__name__)

REPORT_HEADERS = frozenset((AGENT_ID_HEADER, TRUST_BUNDLE_HEADER, LEAF_AUTHORITY_HEADER))
DEFAULT_CAPACITY = 100_000
_AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_AUTHORITY = re.compile(r"[0-9a-f]{2,128}")
_MAX_SUBSET_AUTHORITIES = 10  # 1023 digests; the state never holds that many slots
_MAX_REPORTED_AUTHORITIES = 8  # a fleet signs under a handful of authorities at most


@dataclass(frozen=True)
class AgentReport:
    bundle: str | None  # the trust bundle digest the agent serves, if it sent a valid one
    # The authorities of the leaves it serves, sorted and comma-joined: every one named by its
    # periodic report, kept across its CSRs and moved from the renewed leaf's authority to the
    # signing one when a CSR is answered (`record_issued`); None when it named none.
    authority: str | None
    until: float  # unix seconds after which the entry is forgotten


def _valid(value: str | None, pattern: re.Pattern[str]) -> str | None:
    return value if value is not None and pattern.fullmatch(value) else None


def _bound(table: OrderedDict[str, Any], capacity: int) -> None:
    """Evicts the least recently seen entries beyond `capacity`."""
    while len(table) > capacity:
        table.popitem(last=False)


class AgentReports:
    """This process's table: agent id -> its latest report; unknown callers -> expiry."""

    def __init__(
        self, expire_after: timedelta = timedelta(hours=48), capacity: int = DEFAULT_CAPACITY
    ) -> None:
        self.expire_after = expire_after
        self._capacity = capacity
        self._lock = threading.Lock()
        self._agents: OrderedDict[str, AgentReport] = OrderedDict()
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self.changed = False

    def record(self, headers: Mapping[str, str], caller: str, now: datetime) -> None:
        """One request's headers (lower-case names); `caller` names an agent without an id."""
        until = (now + self.expire_after).timestamp()
        agent_id = _valid(headers.get(AGENT_ID_HEADER), _AGENT_ID)
        with self._lock:
            if agent_id is None:
                self._unknown[caller] = until
                self._unknown.move_to_end(caller)
                _bound(self._unknown, self._capacity)
            else:
                previous = self._agents.get(agent_id)
                self._agents[agent_id] = AgentReport(
                    _valid(headers.get(TRUST_BUNDLE_HEADER), _DIGEST),
                    # A CSR names only the leaf it renews, already among those it serves.
                    previous.authority
                    if previous is not None and previous.authority
                    else _valid(headers.get(LEAF_AUTHORITY_HEADER), _AUTHORITY),
                    until,
                )
                self._agents.move_to_end(agent_id)
                _bound(self._agents, self._capacity)
            self.changed = True

    def record_issued(self, headers: Mapping[str, str], issued_by: str, *, sole_leaf: bool) -> None:
        """A certificate signed by `issued_by` was just issued on a request with `headers`
        (recorded first by `record`): the agent now serves a leaf of `issued_by`, in place of
        the one it renewed when that was its only leaf (`sole_leaf`: a pod agent, not a node
        agent impersonating one of its pods). A node agent's renewed authority may still sign
        its other identities' leaves, so it stays counted until its next periodic report says
        otherwise — an over-count, never an under-count: "nobody serves the old one" is never
        said early."""
        agent_id = _valid(headers.get(AGENT_ID_HEADER), _AGENT_ID)
        if agent_id is None:
            return
        with self._lock:
            entry = self._agents.get(agent_id)
            if entry is None:
                return
            serving = set(entry.authority.split(",")) if entry.authority else set()
            renewed = _valid(headers.get(LEAF_AUTHORITY_HEADER), _AUTHORITY)
            if renewed is not None and sole_leaf:
                serving.discard(renewed)
            serving.add(issued_by)
            joined = ",".join(sorted(serving)[:_MAX_REPORTED_AUTHORITIES])
            self._agents[agent_id] = AgentReport(entry.bundle, joined, entry.until)
            self.changed = True

    def record_periodic(
        self, agent_id: str, bundle: str, authorities: Iterable[str], now: datetime
    ) -> bool:
        """One periodic report (`ca_server.report_service`): the same table and rules as the
        CSR headers, so a report and a CSR from the same agent are one entry, the latest
        winning. Several leaf authorities (a node agent's identities) are kept sorted and
        comma-joined; invalid ones are dropped. False (nothing recorded) without a valid
        agent id: the caller then says what to fix."""
        valid_id = _valid(agent_id, _AGENT_ID)
        if valid_id is None:
            return False
        kept = sorted({a for a in authorities if _valid(a, _AUTHORITY)})[:_MAX_REPORTED_AUTHORITIES]
        report = AgentReport(
            _valid(bundle, _DIGEST), ",".join(kept) or None, (now + self.expire_after).timestamp()
        )
        with self._lock:
            self._agents[valid_id] = report
            self._agents.move_to_end(valid_id)
            _bound(self._agents, self._capacity)
            self.changed = True
        return True

    def snapshot_json(self, now: datetime, max_bytes: int | None = None) -> str:
        """The unexpired entries as JSON (what a sink publishes); clears `changed`. Beyond
        `max_bytes` (a ConfigMap holds 1 MiB) the most recently seen entries that fit are
        kept and the rest are counted in `dropped`, which `show` reports."""
        cutoff = now.timestamp()
        with self._lock:
            self.changed = False
            agents = [
                (agent, [report.bundle, report.authority, round(report.until, 3)])
                for agent, report in reversed(self._agents.items())
                if report.until > cutoff
            ]
            unknown = [(c, round(u, 3)) for c, u in reversed(self._unknown.items()) if u > cutoff]
        budget = max_bytes if max_bytes is not None else -1
        # Three quarters for agents that report, the rest for callers that do not.
        kept_agents, dropped = _within(agents, budget * 3 // 4 if budget >= 0 else None)
        kept_unknown, dropped_unknown = _within(unknown, budget // 4 if budget >= 0 else None)
        snapshot = {
            "agents": dict(kept_agents),
            "unknown": dict(kept_unknown),
            "dropped": dropped + dropped_unknown,
        }
        return json.dumps(snapshot, sort_keys=True)


def _within(
    entries: list[tuple[str, Any]], budget: int | None
) -> tuple[list[tuple[str, Any]], int]:
    """The leading entries whose JSON fits in `budget` bytes (all of them if `None`), and how
    many did not fit."""
    if budget is None:
        return entries, 0
    used = 0
    for index, (key, value) in enumerate(entries):
        used += len(json.dumps(key)) + len(json.dumps(value)) + 4  # ': ' and ', '
        if used > budget:
            return entries[:index], len(entries) - index
    return entries, 0


@dataclass(frozen=True)
class FleetReports:
    """Every process's reports merged: per agent its latest bundle digest, and the callers
    that sent no agent id."""

    bundles: dict[str, str | None]
    unknown: frozenset[str]
    dropped: int = 0  # entries a process could not publish (size limit): not counted
    # Per agent, the authorities of the leaves it serves (empty when it named none).
    leaves: dict[str, frozenset[str]] = field(default_factory=dict)


def merge_snapshots(snapshots: Iterable[tuple[str, str]], now: datetime) -> FleetReports:
    """Merges `(where, snapshot JSON)` pairs, the latest entry per agent winning; unreadable
    snapshots are skipped with a warning naming `where`."""
    cutoff = now.timestamp()
    latest: dict[str, tuple[float, str | None, str | None]] = {}
    unknown: set[str] = set()
    dropped = 0
    for where, text in snapshots:
        try:
            snapshot = json.loads(text)
            dropped += int(snapshot.get("dropped", 0))
            for agent, (bundle, authority, until) in snapshot.get("agents", {}).items():
                if float(until) > cutoff and float(until) > latest.get(agent, (0.0,))[0]:
                    latest[agent] = (
                        float(until),
                        bundle if isinstance(bundle, str) else None,
                        authority if isinstance(authority, str) else None,
                    )
            unknown.update(c for c, u in snapshot.get("unknown", {}).items() if float(u) > cutoff)
        except (ValueError, AttributeError, TypeError) as exc:
            log.warning("ignoring unreadable agent reports %s: %s", where, exc)
    return FleetReports(
        {a: b for a, (_u, b, _l) in latest.items()},
        frozenset(unknown),
        dropped,
        {
            a: frozenset(filter(None, (leaves or "").split(",")))
            for a, (_u, _b, leaves) in latest.items()
        },
    )


def is_spent(text: str, now: datetime) -> bool:
    """True when a snapshot holds no unexpired entry (a gone process's file may be swept)."""
    try:
        snapshot = json.loads(text)
        untils = [e[2] for e in snapshot.get("agents", {}).values()]
        untils += list(snapshot.get("unknown", {}).values())
        return all(float(u) <= now.timestamp() for u in untils)
    except (ValueError, AttributeError, TypeError, IndexError):
        return False


@dataclass(frozen=True)
class Coverage:
    trusting: dict[str, int]  # authority ID -> agents whose bundle holds it
    reporting: int  # agents that sent an agent id (and have not expired)
    unknown: int  # callers that sent none (Istio's agents)
    dropped: int = 0  # reports a CA process could not publish (size limit): not counted
    # authority ID -> agents serving at least one leaf it signed (what `revoke` would break)
    serving: dict[str, int] = field(default_factory=dict)


def coverage(authorities: Sequence[tuple[str, x509.Certificate]], fleet: FleetReports) -> Coverage:
    """Applies the module's rule: `authorities` are (ID, root certificate) of every slot."""
    by_digest: dict[str, frozenset[str]] = {}
    known = list(authorities)[:_MAX_SUBSET_AUTHORITIES]
    for size in range(1, len(known) + 1):
        for subset in itertools.combinations(known, size):
            by_digest[bundle_digest(cert for _id, cert in subset)] = frozenset(
                i for i, _c in subset
            )
    trusting = dict.fromkeys((ident for ident, _cert in authorities), 0)
    for bundle in fleet.bundles.values():
        for ident in by_digest.get(bundle or "", frozenset()):
            trusting[ident] += 1
    serving = dict.fromkeys((ident for ident, _cert in authorities), 0)
    for authorities_served in fleet.leaves.values():
        for ident in authorities_served & serving.keys():
            serving[ident] += 1
    return Coverage(trusting, len(fleet.bundles), len(fleet.unknown), fleet.dropped, serving)
