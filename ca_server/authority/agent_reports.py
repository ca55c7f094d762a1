"""Which trust bundle each agent holds — the figure that says how far a new root has spread.

meshca agents send three headers on every CSR (`agent.propagation`): their run's agent id, the
canonical digest of the trust bundle they serve, and the authority of the leaf they renew; and
the same facts in a light periodic report between renewals (`ca_server.report_service`). The
RPC edges hand them to `AgentReports` — a CSR's only once it was signed (a refused request
records nothing).

**A report counts for the instance its credential proves, never for what it claims.** Each
entry is keyed by `Instance`: the pod the caller's token is bound to (cluster, namespace, pod
name and pod uid, from the verified token's `kubernetes.io` claims or TokenReview's `extra`;
`meshca token` development tokens carry the same claims), checked against the pod informer
when the CA runs one (`PodWatch`: a report from a pod that is gone records nothing). The agent
id the caller chooses is only a label shown beside the entry. So one token can hold at most one
entry: it can say what its own pod trusts and serves, not make up agents, evict them, or change
another pod's entry. A node agent's reports count once, for its own pod, however many
identities the node authorizer lets it serve. A caller whose credential proves no instance
(Istio's agents, a renewal over mTLS, a JWT without pod claims) and a pod that sends no report
headers are *unknown*: at most one per SPIFFE identity, counted apart, never as covered. An
agent restart in the same pod (a new agent id) replaces the pod's entry.

Lifetime of an entry (the rule, in one place): it expires `EXPIRE_AFTER` (four times the longest
report interval an agent accepts, `meshca.wire.MAX_REPORT_INTERVAL`, so 40 min) after
it was last refreshed — a live agent refreshes it every interval (at most 10 min + 20 % jitter),
so only a gone agent's entry expires; an agent with reports turned off (`--report-interval 0`)
counts for that long after each CSR. It is removed at once when the informer says its pod is
gone (`prune`, run before every publication). Each CA process keeps its own table (bounded:
`capacity` entries, least recently refreshed evicted first and counted as *unseen* until they
would have expired) and publishes it with its leaf ledger, republishing at least every
`REPUBLISH_EVERY` (2 min) even when nothing changed. A published snapshot older than
`STALE_AFTER` (the longest report interval plus one republication, 14 min) belongs to a
process that is gone: its agents have reported elsewhere since, so it stops counting. Readers
merge every process's snapshot: per instance the most recently refreshed entry wins (replicas'
clocks are assumed to agree far better than an agent's report interval). In Kubernetes mode
the snapshot is sharded and its liveness is a separate heartbeat, so routine re-reports write
nothing (`ca_server.authority.report_shards`: there the latest `since`, when a process started
holding an entry's content, wins, and `reclaim` keeps that exact for an agent that moved and came
back).

Coverage rule (`coverage`): a digest says nothing by itself about which roots it covers, so the
reader computes the digest of every non-empty subset of the authorities in the shared state
(there are at most a handful) and an agent trusts authority X exactly when its digest is that of
a subset containing X. An agent whose digest matches no subset (a bundle holding roots the CA
no longer knows, or none yet) is *reporting* and trusts none of them: it is never counted as
covered by guesswork. What the reader could not see — entries a process cut to fit its
published object or evicted (`unseen`), a snapshot it could not read (`unreadable`) — counts as
*not trusting* for activation and as *maybe serving* for revoke (`AgentCoverage`,
`ca_server.authority.report`), and every figure says how much that is.

Attribution: every recorded report is counted under its caller's identity (`callers`, bounded
to `MAX_CALLERS` identities, the rest summed as `(other)`), with how often it replaced its
entry's label (a restart, or one token sending made-up agent ids), so an outlier is visible in
`meshca authority show --agents`; a pod's first report is audited (`agent-report-first`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from cryptography import x509

from ca_server.authn import Caller
from ca_server.authority.slots import AgentCoverage
from ca_server.wire import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER
from certs.bundle import bundle_digest
from meshca.logs import audit
from meshca.wire import MAX_REPORT_INTERVAL

log = logging.getLogger(__name__)

REPORT_HEADERS = frozenset((AGENT_ID_HEADER, TRUST_BUNDLE_HEADER, LEAF_AUTHORITY_HEADER))
DEFAULT_CAPACITY = 100_000
EXPIRE_AFTER = 4 * MAX_REPORT_INTERVAL
# A live process republishes at least this often (in Kubernetes mode only a small heartbeat,
# `ca_server.authority.report_shards`): once per default report period, so an idle replica writes
# once.
REPUBLISH_EVERY = timedelta(minutes=2)
STALE_AFTER = MAX_REPORT_INTERVAL * 1.2 + REPUBLISH_EVERY
SNAPSHOT_FORMAT = 2
# Longest values kept (longer ones are refused at the report edge, ignored in CSR headers).
MAX_AGENT_ID = 253
MAX_DIGEST = 64
MAX_AUTHORITY = 128
MAX_REPORTED_AUTHORITIES = 8  # a fleet signs under a handful of authorities at most
MAX_CALLERS = 1000
OTHER_CALLERS = "(other)"
_AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_AUTHORITY = re.compile(r"[0-9a-f]{2,128}")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # DNS-1123, as Kubernetes names
_UID = re.compile(r"[A-Za-z0-9-]{1,64}")
_CLUSTER = re.compile(r"[A-Za-z0-9._:-]{0,128}")
_MAX_SUBSET_AUTHORITIES = 10  # 1023 digests; the state never holds that many slots


def valid(value: str | None, pattern: re.Pattern[str], longest: int) -> str | None:
    """`value` when it has the shape `pattern` wants; the length is checked first, so a huge
    value costs nothing to refuse."""
    if value is None or len(value) > longest or not pattern.fullmatch(value):
        return None
    return value


def valid_agent_id(value: str | None) -> str | None:
    return valid(value, _AGENT_ID, MAX_AGENT_ID)


def valid_digest(value: str | None) -> str | None:
    return valid(value, _DIGEST, MAX_DIGEST)


def valid_authority(value: str | None) -> str | None:
    return valid(value, _AUTHORITY, MAX_AUTHORITY)


@dataclass(frozen=True)
class Instance:
    """The pod a caller's credential proves (see the module docstring)."""

    cluster: str  # "" for tokens no cluster vouched for (local development tokens)
    namespace: str
    pod: str
    uid: str

    @property
    def key(self) -> str:
        # None of the parts can hold "/" (checked by `instance_of`), so the key is unambiguous.
        return f"{self.cluster}/{self.namespace}/{self.pod}/{self.uid}"

    @classmethod
    def from_key(cls, key: str) -> Instance | None:
        parts = key.split("/")
        return cls(*parts) if len(parts) == 4 else None


def instance_of(caller: Caller) -> Instance | None:
    """The pod `caller` authenticated as, or `None` when its credential names none (or names
    one in a shape no Kubernetes pod has)."""
    cluster = str(caller.extra.get("cluster_id", ""))
    if (
        valid(caller.pod_name, _NAME, 253) is None
        or valid(caller.pod_uid, _UID, 64) is None
        or valid(cluster, _CLUSTER, 128) is None
    ):
        return None
    assert caller.pod_name is not None and caller.pod_uid is not None
    return Instance(cluster, caller.identity.namespace, caller.pod_name, caller.pod_uid)


@dataclass(frozen=True)
class PodVerdict:
    live: bool | None  # None: not watched here (no informer, another cluster's pod)
    node: str | None = None


class PodWatch(Protocol):
    """Whether a pod still exists as the token named it (`ca_server.kube.report_pods`)."""

    def verdict(self, instance: Instance) -> PodVerdict: ...


@dataclass(frozen=True)
class AgentEntry:
    identity: str  # the SPIFFE ID the credential proved
    label: str | None  # the agent id the caller chose: shown, never a key
    bundle: str | None  # the trust bundle digest the agent serves, if it sent a valid one
    # The authorities of the leaves it serves, sorted and comma-joined (None: named none).
    authority: str | None
    node: str | None  # from the pod informer, when one runs
    refreshed: float  # unix seconds of the last report
    until: float  # unix seconds after which the entry is forgotten
    # Unix seconds since when this process has held this content for the pod: a routine
    # re-report saying the same leaves it unchanged, so a published shard stays byte-identical
    # (`ca_server.authority.report_shards`); readers let the largest `since` win across processes.
    since: float

    @property
    def content(self) -> tuple[str, str | None, str | None, str | None, str | None]:
        """What a reader counts (not when it was said)."""
        return (self.identity, self.label, self.bundle, self.authority, self.node)


def _joined(authorities: Iterable[str]) -> str | None:
    return ",".join(sorted(set(authorities))[:MAX_REPORTED_AUTHORITIES]) or None


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
    ) -> None:
        """One periodic report (`ca_server.report_service`, which has capped its fields): what
        the caller's pod trusts and serves now, replacing what it said before."""
        instance = instance_of(caller)
        if instance is None:
            self._record_unknown(caller, now)
            return
        kept = [a for a in authorities[:MAX_REPORTED_AUTHORITIES] if valid_authority(a)]
        self._record(caller, instance, valid_agent_id(label), valid_digest(bundle), now, kept)

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
        if previous is not None and previous.label == label and previous.authority:
            serving = set(previous.authority.split(","))
        elif renewed is not None:
            serving = {renewed}  # a CSR names only the leaf it renews
        if renewed is not None and sole_leaf:
            serving.discard(renewed)
        if issued_by:
            serving.add(issued_by)
        digest = valid_digest(headers.get(TRUST_BUNDLE_HEADER))
        self._record(caller, instance, label, digest, now, sorted(serving))

    def _record(
        self,
        caller: Caller,
        instance: Instance,
        label: str | None,
        bundle: str | None,
        now: datetime,
        serving: Iterable[str],
    ) -> None:
        verdict = self.pods.verdict(instance) if self.pods is not None else PodVerdict(None)
        if verdict.live is False:
            return  # its pod is gone: nothing to count (authentication should have refused)
        stamp = now.timestamp()
        key = instance.key
        content = (caller.identity.uri, label, bundle, _joined(serving), verdict.node)
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
        gone = [key for key, entry in items if entry.until <= cutoff or not self._still_live(key)]
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

    def _still_live(self, key: str) -> bool:
        instance = Instance.from_key(key)
        if instance is None or self.pods is None:
            return True
        return self.pods.verdict(instance).live is not False

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
                (key, [e.identity, e.label, e.bundle, e.authority, e.node, e.refreshed, e.until])
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
        """What a sharded publication holds (`ca_server.authority.report_shards`): the unexpired
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


def _fleet_content(
    entry: FleetEntry,
) -> tuple[str, str | None, str | None, str | None, str | None]:
    return (entry.identity, entry.label, entry.bundle, _joined(entry.leaves), entry.node)


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
class FleetEntry:
    """One pod's latest report, as every reader sees it."""

    key: str
    identity: str
    label: str | None
    bundle: str | None
    leaves: frozenset[str]  # authorities of the leaves it serves
    node: str | None
    refreshed: float

    @classmethod
    def decoded(
        cls, key: Any, identity: Any, label: Any, bundle: Any, leaves: Any, node: Any,
        refreshed: Any,
    ) -> FleetEntry:  # fmt: skip
        """An entry from its published JSON fields (a snapshot's or a shard's). An optional
        text of the wrong type reads as absent; a malformed `leaves` or `refreshed` raises, so
        the snapshot counts as unreadable (unseen) rather than as an agent serving nothing."""
        return cls(
            str(key),
            str(identity),
            label if isinstance(label, str) else None,
            bundle if isinstance(bundle, str) else None,
            frozenset(filter(None, (leaves or "").split(","))),
            node if isinstance(node, str) else None,
            float(refreshed),
        )

    @property
    def pod(self) -> str:
        """`namespace/name` of the pod the credential proved."""
        instance = Instance.from_key(self.key)
        return f"{instance.namespace}/{instance.pod}" if instance is not None else self.key


@dataclass(frozen=True)
class FleetReports:
    """Every process's reports merged: per pod its latest entry, the identities that sent no
    instance, and what could not be seen."""

    entries: dict[str, FleetEntry]
    unknown: frozenset[str]
    dropped: int = 0  # entries a process cut to fit or evicted: unseen
    unreadable: int = 0  # snapshots that could not be read: how many agents, nobody knows
    stale: int = 0  # snapshots of processes gone longer than STALE_AFTER: not counted
    callers: dict[str, tuple[int, int]] = field(default_factory=dict)  # identity -> counts

    @classmethod
    def merged(
        cls,
        entries: dict[str, FleetEntry],
        unknown: set[str],
        unseen: tuple[int, int, int],
        callers: dict[str, list[int]],
    ) -> FleetReports:
        """What a merge of snapshots or shards ends with: `unseen` is (dropped, unreadable,
        stale), `callers` the per-identity [reports, relabels] it summed."""
        dropped, unreadable, stale = unseen
        counts = {identity: (c[0], c[1]) for identity, c in callers.items()}
        return cls(entries, frozenset(unknown), dropped, unreadable, stale, counts)

    @property
    def bundles(self) -> dict[str, str | None]:
        return {key: entry.bundle for key, entry in self.entries.items()}

    @property
    def leaves(self) -> dict[str, frozenset[str]]:
        return {key: entry.leaves for key, entry in self.entries.items()}


@dataclass(frozen=True)
class ParsedSnapshot:
    """One published snapshot, parsed once (`SnapshotCache`)."""

    published: float
    entries: tuple[tuple[FleetEntry, float], ...]  # (entry, until)
    unknown: tuple[tuple[str, float], ...]
    dropped: int
    callers: tuple[tuple[str, int, int], ...]


class LegacySnapshot(ValueError):
    """A snapshot of an older CA version (keyed on caller-chosen ids): never counted."""


def parse_snapshot(text: str) -> ParsedSnapshot:
    """Raises `ValueError`/`TypeError`/`KeyError` for an unreadable snapshot, `LegacySnapshot`
    for an old one."""
    snapshot = json.loads(text)
    if not isinstance(snapshot, dict):
        raise TypeError("not a JSON object")
    if snapshot.get("format") != SNAPSHOT_FORMAT:
        raise LegacySnapshot("an older format")
    agents = snapshot.get("agents", {})
    if not isinstance(agents, dict):
        raise TypeError("agents is not an object")
    entries = []
    for key, (identity, label, bundle, authority, node, refreshed, until) in agents.items():
        entry = FleetEntry.decoded(key, identity, label, bundle, authority, node, refreshed)
        entries.append((entry, float(until)))
    return ParsedSnapshot(
        float(snapshot["published"]),
        tuple(entries),
        tuple((str(c), float(u)) for c, u in snapshot.get("unknown", {}).items()),
        int(snapshot.get("dropped", 0)),
        tuple(
            (str(identity), int(reports), int(relabels))
            for identity, (reports, relabels) in snapshot.get("callers", {}).items()
        ),
    )


class SnapshotCache:
    """Parsed snapshots by where they were read and a digest of their text, so a reader that
    merges every round parses only what changed since the last one (a snapshot of 10,000
    entries costs one SHA-256 of its text when it did not change). Bounded: entries not seen
    in the last merge are forgotten."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[bytes, ParsedSnapshot | Exception]] = {}
        self._lock = threading.Lock()
        # The last merge: what it read, its result, and until when that result holds.
        self.merged: tuple[list[tuple[str, bytes]], FleetReports, float] | None = None

    def parse(self, where: str, text: str) -> ParsedSnapshot:
        """`text` parsed (once per distinct text at `where`); raises what parsing raised."""
        result = self.parse_with_digest(where, text)[1]
        if isinstance(result, Exception):
            raise result
        return result

    def parse_with_digest(self, where: str, text: str) -> tuple[bytes, ParsedSnapshot | Exception]:
        """The digest of `text` and what it parses to (or the error it raises)."""
        digest = hashlib.sha256(text.encode()).digest()
        with self._lock:
            cached = self._parsed.get(where)
        if cached is not None and cached[0] == digest:
            result = cached[1]
        else:
            try:
                result = parse_snapshot(text)
            except (ValueError, AttributeError, TypeError, KeyError) as exc:
                result = exc
            with self._lock:
                self._parsed[where] = (digest, result)
        return digest, result

    def keep_only(self, wheres: set[str]) -> None:
        with self._lock:
            for where in [w for w in self._parsed if w not in wheres]:
                del self._parsed[where]


def merge_snapshots(
    snapshots: Iterable[tuple[str, str]],
    now: datetime,
    pods: PodWatch | None = None,
    cache: SnapshotCache | None = None,
) -> FleetReports:
    """Merges `(where, snapshot JSON)` pairs, the most recently refreshed entry per pod
    winning, without the entries of pods `pods` says are gone. An unreadable snapshot is
    counted (and warned about, naming `where`); a stale or old-format one is left out."""
    cutoff = now.timestamp()
    cache = cache if cache is not None else SnapshotCache()
    parsed = [(where, *cache.parse_with_digest(where, text)) for where, text in snapshots]
    signature = [(where, digest) for where, digest, _ in parsed]
    merged = cache.merged
    if merged is not None and merged[0] == signature and cutoff < merged[2]:
        result = merged[1]  # nothing changed and nothing expired since: no merge
    else:
        result = _merge(parsed, cutoff, cache)
    return without_gone_pods(result, pods)


def without_gone_pods(fleet: FleetReports, pods: PodWatch | None) -> FleetReports:
    """`fleet` without the entries of pods the informer says are gone (whichever process
    published them)."""
    if pods is None:
        return fleet
    entries = {
        key: entry
        for key, entry in fleet.entries.items()
        if (instance := Instance.from_key(key)) is None or pods.verdict(instance).live is not False
    }
    return dataclasses.replace(fleet, entries=entries)


def _merge(
    snapshots: list[tuple[str, bytes, ParsedSnapshot | Exception]],
    cutoff: float,
    cache: SnapshotCache,
) -> FleetReports:
    signature = [(where, digest) for where, digest, _ in snapshots]
    stale_before = cutoff - STALE_AFTER.total_seconds()
    holds_until = math.inf  # the soonest an entry expires or a snapshot turns stale
    latest: dict[str, FleetEntry] = {}
    unknown: set[str] = set()
    callers: dict[str, list[int]] = {}
    dropped = unreadable = stale = 0
    wheres: set[str] = set()
    for where, _digest, parsed in snapshots:
        wheres.add(where)
        if isinstance(parsed, LegacySnapshot):
            stale += 1
            continue
        if isinstance(parsed, Exception):
            log.warning("cannot read agent reports %s: %s", where, parsed)
            unreadable += 1
            continue
        if parsed.published <= stale_before:
            stale += 1
            continue
        holds_until = min(holds_until, parsed.published + STALE_AFTER.total_seconds())
        dropped += parsed.dropped
        unknown.update(c for c, u in parsed.unknown if u > cutoff)
        holds_until = min([holds_until, *(u for _c, u in parsed.unknown if u > cutoff)])
        for identity, reports, relabels in parsed.callers:
            counts = callers.setdefault(identity, [0, 0])
            counts[0] += reports
            counts[1] += relabels
        for entry, until in parsed.entries:
            if until <= cutoff:
                continue
            if until < holds_until:
                holds_until = until
            current = latest.get(entry.key)
            if current is None or entry.refreshed > current.refreshed:
                latest[entry.key] = entry
    cache.keep_only(wheres)
    result = FleetReports.merged(latest, unknown, (dropped, unreadable, stale), callers)
    cache.merged = (signature, result, holds_until)
    return result


def is_spent(text: str, now: datetime) -> bool:
    """True when a snapshot no longer counts for anything (a gone process's file may be
    swept): stale, of an older format, or holding no unexpired entry."""
    try:
        snapshot = json.loads(text)
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            return True
        if float(snapshot["published"]) + STALE_AFTER.total_seconds() <= now.timestamp():
            return True
        untils = [e[6] for e in snapshot.get("agents", {}).values()]
        untils += list(snapshot.get("unknown", {}).values())
        return all(float(u) <= now.timestamp() for u in untils)
    except (ValueError, AttributeError, TypeError, IndexError, KeyError):
        return False


@dataclass(frozen=True)
class Coverage:
    trusting: dict[str, int]  # authority ID -> agents whose bundle holds it
    reporting: int  # pods with a report (and not expired)
    unknown: int  # identities that proved no instance or sent no report (Istio's agents)
    dropped: int = 0  # reports a CA process cut or evicted: unseen, counted as not trusting
    # authority ID -> agents serving at least one leaf it signed (what `revoke` would break)
    serving: dict[str, int] = field(default_factory=dict)
    unreadable: int = 0  # snapshots that could not be read: no figure is complete

    @property
    def unseen(self) -> int:
        return self.dropped


def subset_digests(
    authorities: Sequence[tuple[str, x509.Certificate]],
) -> dict[str, frozenset[str]]:
    """The digest of every non-empty subset of `authorities` -> the IDs in it."""
    by_digest: dict[str, frozenset[str]] = {}
    known = list(authorities)[:_MAX_SUBSET_AUTHORITIES]
    for size in range(1, len(known) + 1):
        for subset in itertools.combinations(known, size):
            by_digest[bundle_digest(cert for _id, cert in subset)] = frozenset(
                i for i, _c in subset
            )
    return by_digest


def gate_coverage(
    authorities: Sequence[tuple[str, x509.Certificate]], fleet: FleetReports, ident: str
) -> AgentCoverage:
    """The activation gate's figure for authority `ident` among `authorities` (what the self-
    signed gate and the plugged-in guard both ask, from every CA process's reports)."""
    counted = coverage(authorities, fleet)
    return AgentCoverage(
        counted.trusting.get(ident, 0), counted.reporting, counted.unseen, counted.unreadable
    )


def coverage(authorities: Sequence[tuple[str, x509.Certificate]], fleet: FleetReports) -> Coverage:
    """Applies the module's rule: `authorities` are (ID, root certificate) of every slot."""
    by_digest = subset_digests(authorities)
    trusting = dict.fromkeys((ident for ident, _cert in authorities), 0)
    serving = dict.fromkeys((ident for ident, _cert in authorities), 0)
    for entry in fleet.entries.values():
        for ident in by_digest.get(entry.bundle or "", frozenset()):
            trusting[ident] += 1
        for ident in entry.leaves & serving.keys():
            serving[ident] += 1
    return Coverage(
        trusting,
        len(fleet.entries),
        len(fleet.unknown),
        fleet.dropped,
        serving,
        fleet.unreadable,
    )
