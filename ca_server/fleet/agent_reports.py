"""This CA process's table of agent reports: one entry per pod its callers' credentials prove.

The RPC edges record into it (`record_report` from `ca_server.report_service`, `record_csr`
from `ca_server.service` once a certificate was signed); the authority driver's ledger sink
publishes it beside the leaf ledger (`ca_server.fleet.leaf_ledger`; sharded in Kubernetes
mode, `ca_server.fleet.report_shards`). What an entry holds, whose it is and how long it counts
is `ca_server.fleet.entries`; how readers merge every process's table is `ca_server.fleet.merge`.

Each CA process keeps its own table, bounded: `capacity` entries, least recently refreshed
evicted first and counted as *unseen* until they would have expired. Expired entries and those
of pods the informer says are gone are dropped by `prune`, run before every publication; `due`
says when a sink should publish (something changed, or `REPUBLISH_EVERY` passed). Readers let
the most recently refreshed entry per pod win; with shards the latest `since` — when a process
started holding an entry's content — wins, and `reclaim` keeps that exact for an agent that
moved to another process and came back.

Attribution: every recorded report is counted under its caller's identity (`callers`, bounded
to `MAX_CALLERS` identities, the rest summed as `(other)`), with how often it replaced its
entry's label (a restart, or one token sending made-up agent ids), so an outlier is visible in
`meshca authority show --agents`; a pod's first report is audited (`agent-report-first`).

Thread-safety: recorded on the CA's event loop, published from a worker thread; a lock guards
the table.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from ca_server.authn import Caller
from ca_server.fleet.entries import (
    EXPIRE_AFTER,
    MAX_REPORTED_AUTHORITIES,
    MAX_REPORTED_JWT_KEYS,
    REPUBLISH_EVERY,
    SNAPSHOT_FORMAT,
    AgentEntry,
    EntryContent,
    FleetEntry,
    FleetReports,
    Instance,
    PodVerdict,
    PodWatch,
    instance_of,
    published_fields,
    valid_agent_id,
    valid_authority,
    valid_digest,
    valid_jwt_kid,
)
from ca_server.wire import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER
from meshca.logs import audit

DEFAULT_CAPACITY = 100_000
MAX_CALLERS = 1000
OTHER_CALLERS = "(other)"


def _joined(authorities: Iterable[str], cap: int = MAX_REPORTED_AUTHORITIES) -> str | None:
    return ",".join(sorted(set(authorities))[:cap]) or None


class AgentReports:
    """This process's table: instance key -> its latest entry; unknown identities -> expiry."""

    def __init__(
        self,
        expire_after: timedelta = EXPIRE_AFTER,
        capacity: int = DEFAULT_CAPACITY,
        pods: PodWatch | None = None,
    ) -> None:
        self.expire_after = expire_after
        self.pods = pods
        self._capacity = capacity
        self._lock = threading.Lock()
        self._agents: OrderedDict[str, AgentEntry] = OrderedDict()
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._evicted: OrderedDict[str, float] = OrderedDict()  # key -> until (unseen)
        self._callers: dict[str, list[int]] = {}  # identity -> [reports, relabels]
        self._published: float | None = None
        self._touched: set[str] = set()  # keys recorded since the last `reclaim`
        self.changed = False

    # -- recording ---------------------------------------------------------------------------

    def record_report(
        self,
        caller: Caller,
        label: str,
        bundle: str | None,
        authorities: Sequence[str],
        now: datetime,
        *,
        jwt_keys: Sequence[str] = (),
    ) -> None:
        """One periodic report (`ca_server.report_service`, which has capped its fields): what
        the caller's pod trusts and serves now, and the JWT kids it holds, replacing what it
        said before."""
        instance = instance_of(caller)
        if instance is None:
            self._record_unknown(caller, now)
            return
        kept = [a for a in authorities[:MAX_REPORTED_AUTHORITIES] if valid_authority(a)]
        kids = _joined(
            (k for k in jwt_keys[:MAX_REPORTED_JWT_KEYS] if valid_jwt_kid(k)),
            MAX_REPORTED_JWT_KEYS,
        )
        self._record(caller, instance, valid_agent_id(label), valid_digest(bundle), now, kept, kids)

    def record_csr(
        self,
        caller: Caller,
        headers: Mapping[str, str],
        issued_by: str,
        *,
        sole_leaf: bool,
        now: datetime,
    ) -> None:
        """A certificate signed by `issued_by` was just issued to `caller` on a request with
        these report headers (lower-case names; empty for Istio's agents). The agent now serves
        a leaf of `issued_by`, in place of the one it renewed when that was its only leaf
        (`sole_leaf`: a pod agent, not a node agent impersonating one of its pods, whose renewed
        authority may still sign its other identities' leaves and so stays counted until its
        next periodic report says otherwise — an over-count, never an under-count)."""
        label = valid_agent_id(headers.get(AGENT_ID_HEADER))
        # Istio's agents send no label: the pod is not looked at then (`instance_of` is pure).
        instance = instance_of(caller) if label is not None else None
        if label is None or instance is None:
            self._record_unknown(caller, now)
            return
        renewed = valid_authority(headers.get(LEAF_AUTHORITY_HEADER))
        with self._lock:
            previous = self._agents.get(instance.key)
        serving: set[str] = set()
        # A CSR says nothing of JWT keys: the same run's last report still holds.
        kids = previous.jwt_keys if previous is not None and previous.label == label else None
        if previous is not None and previous.label == label and previous.authority:
            serving = set(previous.authority.split(","))
        elif renewed is not None:
            serving = {renewed}  # a CSR names only the leaf it renews
        if renewed is not None and sole_leaf:
            serving.discard(renewed)
        if issued_by:
            serving.add(issued_by)
        digest = valid_digest(headers.get(TRUST_BUNDLE_HEADER))
        self._record(caller, instance, label, digest, now, sorted(serving), kids)

    def _record(
        self,
        caller: Caller,
        instance: Instance,
        label: str | None,
        bundle: str | None,
        now: datetime,
        serving: Iterable[str],
        jwt_keys: str | None = None,
    ) -> None:
        verdict = self.pods.verdict(instance) if self.pods is not None else PodVerdict(None)
        if verdict.live is False:
            return  # its pod is gone: nothing to count (authentication should have refused)
        stamp = now.timestamp()
        key = instance.key
        content = (caller.identity.uri, label, bundle, _joined(serving), verdict.node, jwt_keys)
        with self._lock:
            previous = self._agents.pop(key, None)
            same = previous is not None and previous.content == content
            since = previous.since if same and previous is not None else stamp
            entry = AgentEntry(*content, stamp, stamp + self.expire_after.total_seconds(), since)
            self._agents[key] = entry
            self._touched.add(key)
            self._evicted.pop(key, None)
            self._count_caller(
                caller.identity.uri, relabel=previous is not None and (previous.label != label)
            )
            while len(self._agents) > self._capacity:
                gone, evicted = self._agents.popitem(last=False)
                self._touched.discard(gone)
                self._evicted[gone] = evicted.until
                while len(self._evicted) > self._capacity:
                    self._evicted.popitem(last=False)
            self.changed = True
        if previous is None:
            audit(
                "agent-report-first",
                outcome="recorded",
                identity=caller.identity.uri,
                caller=caller.subject,
                pod=f"{instance.namespace}/{instance.pod}",
                pod_uid=instance.uid,
                node=verdict.node,
                label=label,
            )

    def _record_unknown(self, caller: Caller, now: datetime) -> None:
        identity = caller.identity.uri
        with self._lock:
            self._unknown[identity] = (now + self.expire_after).timestamp()
            self._unknown.move_to_end(identity)
            while len(self._unknown) > self._capacity:
                self._unknown.popitem(last=False)
            self._count_caller(identity, relabel=False)
            self.changed = True

    def _count_caller(self, identity: str, *, relabel: bool) -> None:
        """Under the lock: the bounded per-identity attribution counter."""
        if identity not in self._callers and len(self._callers) >= MAX_CALLERS:
            identity = OTHER_CALLERS
        counts = self._callers.setdefault(identity, [0, 0])
        counts[0] += 1
        counts[1] += 1 if relabel else 0

    # -- upkeep and publication --------------------------------------------------------------

    def prune(self, now: datetime) -> int:
        """Forgets expired entries and those whose pod the informer says is gone; how many."""
        cutoff = now.timestamp()
        with self._lock:
            items = list(self._agents.items())
        unexpired = [key for key, entry in items if entry.until > cutoff]
        live = self._still_live(unexpired)
        gone = [key for key, entry in items if entry.until <= cutoff or key not in live]
        with self._lock:
            for key in gone:
                self._agents.pop(key, None)
                self._touched.discard(key)
            for key in [k for k, u in self._evicted.items() if u <= cutoff]:
                del self._evicted[key]
            for identity in [i for i, u in self._unknown.items() if u <= cutoff]:
                del self._unknown[identity]
            if gone:
                self.changed = True
        return len(gone)

    def _still_live(self, keys: list[str]) -> set[str]:
        """Those of `keys` whose pod is not known to be gone: one batch for the pod watch."""
        if self.pods is None:
            return set(keys)
        instances = [(key, Instance.from_key(key)) for key in keys]
        asked = [(key, instance) for key, instance in instances if instance is not None]
        verdicts = self.pods.verdicts([instance for _, instance in asked])
        gone = {
            key for (key, _), verdict in zip(asked, verdicts, strict=True) if verdict.live is False
        }
        return {key for key in keys if key not in gone}

    def due(self, now: datetime) -> bool:
        """Whether a sink should publish now: something changed, or the last publication is
        old enough that readers would soon take this process for gone (`STALE_AFTER`)."""
        published = self._published
        return (
            self.changed
            or published is None
            or now.timestamp() - published >= REPUBLISH_EVERY.total_seconds()
        )

    def __len__(self) -> int:
        return len(self._agents)

    def snapshot_json(self, now: datetime, max_bytes: int | None = None) -> str:
        """The unexpired entries as JSON (what a sink publishes); clears `changed`. Beyond
        `max_bytes` (a ConfigMap holds 1 MiB) the most recently refreshed entries that fit are
        kept and the rest are counted in `dropped` (unseen: not trusting, maybe serving)."""
        cutoff = now.timestamp()
        with self._lock:
            self.changed = False
            self._published = cutoff
            agents = [
                (key, published_fields(e.content, e.refreshed, e.until))
                for key, e in reversed(self._agents.items())
                if e.until > cutoff
            ]
            unknown = [(c, round(u, 3)) for c, u in reversed(self._unknown.items()) if u > cutoff]
            evicted = sum(1 for u in self._evicted.values() if u > cutoff)
            callers = {identity: list(counts) for identity, counts in self._callers.items()}
        budget = max_bytes if max_bytes is not None else -1
        # Three quarters for agents that report, the rest for callers that do not.
        kept_agents, dropped = _within(agents, budget * 3 // 4 if budget >= 0 else None)
        kept_unknown, _ = _within(unknown, budget // 8 if budget >= 0 else None)
        top = sorted(callers.items(), key=lambda item: -item[1][0])
        kept_callers, _ = _within(top, budget // 8 if budget >= 0 else None)
        snapshot = {
            "format": SNAPSHOT_FORMAT,
            "published": cutoff,
            "agents": dict(kept_agents),
            "unknown": dict(kept_unknown),
            "dropped": dropped + evicted,
            "callers": dict(kept_callers),
        }
        return json.dumps(snapshot, sort_keys=True)

    def reclaim(self, fleet: FleetReports) -> int:
        """After an agent moved to another process and came back saying what this process's
        older entry already said, that entry's `since` is older than the other process's copy,
        which would keep winning though it is no longer what the agent says. For every pod
        recorded since the last call whose report here is newer than the copy every reader
        sees (`fleet`, this process's last merge) and says something else, `since` becomes
        the time of that report, so the next publication wins. How many were reclaimed."""
        reclaimed = 0
        with self._lock:
            touched, self._touched = self._touched, set()
            for key in touched:
                own = self._agents.get(key)
                seen = fleet.entries.get(key)
                if own is None or seen is None or own.since >= seen.refreshed:
                    continue
                if own.refreshed > seen.refreshed and _fleet_content(seen) != own.content:
                    self._agents[key] = dataclasses.replace(own, since=own.refreshed)
                    reclaimed += 1
            if reclaimed:
                self.changed = True
        return reclaimed

    def shard_view(
        self, now: datetime
    ) -> tuple[list[tuple[str, AgentEntry]], dict[str, float], int, list[tuple[str, list[int]]]]:
        """What a sharded publication holds (`ca_server.fleet.report_shards`): the unexpired
        entries (most recently refreshed first), the unknown identities -> expiry, how many evicted
        entries are still unseen, and the callers by reports. Clears `changed`."""
        cutoff = now.timestamp()
        with self._lock:
            self.changed = False
            self._published = cutoff
            agents = [(key, e) for key, e in reversed(self._agents.items()) if e.until > cutoff]
            unknown = {c: round(u, 3) for c, u in self._unknown.items() if u > cutoff}
            evicted = sum(1 for u in self._evicted.values() if u > cutoff)
            callers = sorted(
                ((i, list(c)) for i, c in self._callers.items()), key=lambda item: -item[1][0]
            )
        return agents, unknown, evicted, callers


def _fleet_content(entry: FleetEntry) -> EntryContent:
    kids = _joined(entry.jwt_keys, MAX_REPORTED_JWT_KEYS)
    return (entry.identity, entry.label, entry.bundle, _joined(entry.leaves), entry.node, kids)


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
