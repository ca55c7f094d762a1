"""Agent reports published as shards plus a heartbeat, and their incremental merge (issue #17:
100,000 agents, at most one API write per replica per report period when nothing changes, a
merge that costs little when nothing changed).

**Content apart from liveness.** A shard holds, per pod, only what a decision reads (identity,
label, bundle digest, leaf authorities, node) and `since` — when this process started holding
that content (`AgentEntry.since`) — never the time of the last report or an expiry. A routine
re-report saying the same thing leaves every byte of its shard unchanged, so the shard is not
rewritten and no reader parses it again. Liveness lives in one small **heartbeat** per process
(`heartbeat_text`): "alive at `published`; my shards are these generations", republished every
`REPUBLISH_EVERY` (once per default report period), with what is not per pod (unknown
identities, the dropped count, the callers). The publishing process prunes expired and gone
entries from its own table; that is a content change, so the shard is rewritten then.

**Rules a reader applies (`ShardMerger`)**, all conservative:
- a process whose heartbeat is older than `STALE_AFTER` is gone: none of its shards count
  (its agents have reported elsewhere since) — the same 14-minute rule snapshots had;
- a shard counts when its generation is the one the live heartbeat lists, or when it was
  written after that heartbeat (a newer shard is as current as its writer);
- a shard the heartbeat lists that the reader cannot see in that generation or newer (missing,
  or an older text: a write in flight, a failed write) is *unreadable*: not trusting for
  activation, maybe serving for revoke, and no figure is complete — it is never counted with
  what an older text said;
- a shard object without a heartbeat (its process's report is gone) is unreadable until it is
  older than `STALE_AFTER`, then stale;
- per pod the entry with the largest `since` wins across processes (an agent that moved and
  came back is reclaimed by `AgentReports.reclaim`).

The merge is incremental: parsed shards are kept by generation (a string compare per shard,
no hashing of large texts), and only the pods of shards that changed are re-decided, so an
idle round costs O(objects) and a round under churn O(changed shards).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ca_server.fleet.entries import (
    STALE_AFTER,
    AgentEntry,
    FleetEntry,
    FleetReports,
    published_fields,
    split_published,
)
from ca_server.fleet.merge import is_spent

log = logging.getLogger(__name__)

SHARD_FORMAT = 3
MAX_PUBLISHED_CALLERS = 200  # the top identities by reports, in the heartbeat
# JSON punctuation (quotes, brackets, separators) and `since`; a `null` costs 4 more.
_ENTRY_OVERHEAD = 46
_DIGEST_MODULUS = 2**64


def shard_of(key: str, count: int) -> int:
    """The stable shard of a pod key among `count`: CRC-32 mixed by the golden-ratio constant,
    scaled to the range (so any count works, not only powers of two: fewer, fuller shards
    mean fewer writes under churn), the same in every process and run. (CRC-32's own low bits
    spread keys that differ in a counter unevenly, up to 1.8x between shards.)"""
    mixed = (zlib.crc32(key.encode()) * 0x9E3779B1) & 0xFFFFFFFF
    return (mixed * count) >> 32


def generation_of(text: str) -> str:
    """A shard text's generation: a digest the writer computes once per write, so a reader
    compares strings instead of hashing ~700 KiB per shard per round."""
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Shard:
    index: int
    count: int
    # key -> [identity, label, bundle, authority, node, since(, JWT kids when it holds some)]
    agents: dict[str, list[Any]]
    # A digest of the content (not comparable across processes: `hash()`), so a sink rewrites
    # a shard only when it changed.
    decision: str

    def text(self, written: float) -> str:
        body = {
            "format": SHARD_FORMAT,
            "shard": [self.index, self.count],
            "written": written,
            "agents": self.agents,
        }
        return json.dumps(body, sort_keys=True)


@dataclass(frozen=True)
class Layout:
    """One publication: the shards, and what the heartbeat carries besides generations."""

    shards: list[Shard]
    unknown: dict[str, float]
    dropped: int
    callers: dict[str, list[int]]

    @property
    def heartbeat_decision(self) -> str:
        """What in the heartbeat a decision reads (who is unknown, how many dropped)."""
        return str((hash(tuple(sorted(self.unknown))), self.dropped, len(self.shards)))


def build_layout(
    view: tuple[list[tuple[str, AgentEntry]], dict[str, float], int, list[tuple[str, list[int]]]],
    shard_bytes: int,
    max_shards: int = 64,
    previous_count: int = 0,
) -> Layout:
    """Splits `AgentReports.shard_view` by a stable hash of the pod key into as many shards (at
    most `max_shards`) as it takes for each to fit in `shard_bytes` (a Kubernetes object holds
    1 MiB). An entry stays in its shard while the fleet size keeps the shard count (a resize
    rewrites every shard once). Beyond full shards the most recently refreshed entries are
    kept and the rest counted as dropped (unseen)."""
    agents, unknown, evicted, callers = view
    sizes = [_ENTRY_OVERHEAD + len(key) + _content_size(e) for key, e in agents]
    # A sixth spare for the hash's skew (a few percent at ~2,000 entries a shard) and growth;
    # the count in use is kept while it still leaves a twelfth spare and is at least half used,
    # so a fleet growing or shrinking slowly does not rewrite every shard at each step. A count
    # that would cut entries (few entries a shard skew more) grows until none are cut.
    total, budget = sum(sizes), max(1, shard_bytes)
    count = max(1, min(max_shards, -(-total * 7 // 6 // budget)))
    if (
        previous_count
        and total * 13 // 12 <= previous_count * budget
        and (previous_count == 1 or total * 2 >= previous_count * budget)
    ):
        count = previous_count
    while True:
        buckets: list[dict[str, list[Any]]] = [{} for _ in range(count)]
        decisions = [0] * count
        used = [0] * count
        cut = 0
        for (key, e), size in zip(agents, sizes, strict=True):
            index = shard_of(key, count)
            if used[index] + size > shard_bytes:
                cut += 1
                continue
            used[index] += size
            digest = hash((key, *e.content, e.since))
            decisions[index] = (decisions[index] + digest) % _DIGEST_MODULUS
            buckets[index][key] = published_fields(e.content, e.since)
        if not cut or count >= max_shards:
            break
        count += 1
    dropped = evicted + cut
    shards = [
        Shard(index, count, bucket, str((len(bucket), decisions[index])))
        for index, bucket in enumerate(buckets)
    ]
    kept = {identity: counts for identity, counts in callers[:MAX_PUBLISHED_CALLERS]}
    return Layout(shards, unknown, dropped, kept)


def _content_size(entry: AgentEntry) -> int:
    """The published size of an entry's fields (`published_fields`): the JWT kids count only
    when present (quotes and a comma)."""
    *counted, jwt_keys = entry.content
    size = sum(4 if v is None else len(v) for v in counted)
    return size + (len(jwt_keys) + 3 if jwt_keys else 0)


def heartbeat_text(layout: Layout, generations: Mapping[int, str], now: datetime) -> str:
    """This process is alive at `now`, and its shards are these generations."""
    body = {
        "format": SHARD_FORMAT,
        "published": now.timestamp(),
        "shards": {str(index): generation for index, generation in generations.items()},
        "unknown": layout.unknown,
        "dropped": layout.dropped,
        "callers": layout.callers,
    }
    return json.dumps(body, sort_keys=True)


@dataclass(frozen=True)
class Heartbeat:
    published: float
    shards: dict[int, str]
    unknown: tuple[tuple[str, float], ...]
    dropped: int
    callers: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class ParsedShard:
    written: float
    entries: dict[str, FleetEntry]  # pod key -> entry
    raw: dict[str, list[Any]]  # pod key -> the published list (to reuse unchanged entries)


class WrongFormat(ValueError):
    """Not of `SHARD_FORMAT` (an older CA version's snapshot, or not a report at all)."""


def parse_heartbeat(text: str) -> Heartbeat:
    """Raises `ValueError`/`TypeError`/`KeyError`/`AttributeError` when unreadable."""
    body = json.loads(text)
    if not isinstance(body, dict) or body.get("format") != SHARD_FORMAT:
        raise WrongFormat("not a heartbeat of this format")
    return Heartbeat(
        float(body["published"]),
        {int(index): str(gen) for index, gen in body["shards"].items()},
        tuple((str(c), float(u)) for c, u in body.get("unknown", {}).items()),
        int(body.get("dropped", 0)),
        tuple(
            (str(identity), int(reports), int(relabels))
            for identity, (reports, relabels) in body.get("callers", {}).items()
        ),
    )


def parse_shard(text: str, previous: ParsedShard | None = None) -> ParsedShard:
    """Raises `ValueError`/`TypeError`/`KeyError`/`AttributeError` when unreadable. An entry
    published exactly as in `previous` (the same shard's last text) is that same object, so a
    merge re-decides only the pods whose entry changed."""
    body = json.loads(text)
    if not isinstance(body, dict) or body.get("format") != SHARD_FORMAT:
        raise WrongFormat("not a shard of this format")
    old_raw = previous.raw if previous is not None else {}
    old_entries = previous.entries if previous is not None else {}
    entries: dict[str, FleetEntry] = {}
    raw: dict[str, list[Any]] = body["agents"]
    for key, published in raw.items():
        if old_raw.get(key) == published:
            entries[key] = old_entries[key]
            continue
        counted, jwt_keys = split_published(published, times=1)
        identity, label, bundle, authority, node, since = counted
        entries[key] = FleetEntry.decoded(
            key, identity, label, bundle, authority, node, since, jwt_keys
        )
    return ParsedShard(float(body["written"]), entries, raw)


@dataclass(frozen=True)
class ShardObject:
    """One shard as a reader found it: where (for messages and caches), its generation (the
    writer's, or computed here when absent), its text."""

    where: str
    generation: str
    text: str


@dataclass(frozen=True)
class ProcessReports:
    """One publishing process's heartbeat (`None`: its report object is missing) and the shard
    objects found for it, by index."""

    where: str
    heartbeat: str | None
    shards: dict[int, ShardObject] = field(default_factory=dict)


_PARSE_ERRORS = (ValueError, TypeError, KeyError, AttributeError)


class ShardMerger:
    """A reader's merged view, kept between rounds and updated by what changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parsed: dict[str, tuple[str, ParsedShard | Exception]] = {}  # where -> (gen, …)
        self._heartbeats: dict[str, tuple[str, Heartbeat | Exception]] = {}  # where -> text
        self._counted: dict[str, str] = {}  # shard where -> generation in `_candidates`
        self._counted_entries: dict[str, dict[str, FleetEntry]] = {}
        self._candidates: dict[str, dict[str, FleetEntry]] = {}  # pod key -> where -> entry
        self._latest: dict[str, FleetEntry] = {}
        self._entries: dict[str, FleetEntry] = {}  # the last published copy of `_latest`
        self._result: tuple[tuple[Any, ...], float, FleetReports] | None = None
        self.last: FleetReports | None = None
        self.reparsed = 0  # shard texts parsed by the last merge (for tests and benches)

    def merge(self, processes: list[ProcessReports], now: datetime) -> FleetReports:
        with self._lock:
            result = self._merge(processes, now.timestamp())
            self.last = result
            return result

    def _heartbeat(self, where: str, text: str) -> Heartbeat | Exception:
        cached = self._heartbeats.get(where)
        if cached is not None and cached[0] == text:
            return cached[1]
        parsed: Heartbeat | Exception
        try:
            parsed = parse_heartbeat(text)
        except _PARSE_ERRORS as exc:
            parsed = exc
        self._heartbeats[where] = (text, parsed)
        return parsed

    def _shard(self, shard: ShardObject) -> ParsedShard | Exception:
        cached = self._parsed.get(shard.where)
        if cached is not None and cached[0] == shard.generation:
            return cached[1]
        previous = cached[1] if cached is not None else None
        parsed: ParsedShard | Exception
        try:
            parsed = parse_shard(
                shard.text, previous if isinstance(previous, ParsedShard) else None
            )
        except _PARSE_ERRORS as exc:
            parsed = exc
        self.reparsed += 1
        self._parsed[shard.where] = (shard.generation, parsed)
        return parsed

    def _merge(self, processes: list[ProcessReports], cutoff: float) -> FleetReports:
        self.reparsed = 0
        stale_for = STALE_AFTER.total_seconds()
        holds_until = math.inf  # the soonest a heartbeat turns stale or an unknown expires
        wanted: dict[str, tuple[str, ParsedShard]] = {}
        unknown: set[str] = set()
        callers: dict[str, list[int]] = {}
        dropped = unreadable = stale = 0
        signature: list[Any] = []
        for process in processes:
            beat = self._heartbeat(process.where, process.heartbeat) if process.heartbeat else None
            signature.append((process.where, process.heartbeat))
            if beat is None:  # no report object: shards of a process that is gone or starting
                for shard in process.shards.values():
                    parsed = self._shard(shard)
                    if isinstance(parsed, WrongFormat):  # an older CA version's snapshot
                        spent = is_spent(shard.text, datetime.fromtimestamp(cutoff, UTC))
                        stale, unreadable = (
                            (stale + 1, unreadable) if spent else (stale, unreadable + 1)
                        )
                    elif isinstance(parsed, ParsedShard) and parsed.written > cutoff - stale_for:
                        unreadable += 1  # its heartbeat may follow: not counted, not ignored
                        holds_until = min(holds_until, parsed.written + stale_for)
                    else:
                        stale += 1
                continue
            if isinstance(beat, Exception):
                log.warning("cannot read agent reports %s: %s", process.where, beat)
                unreadable += 1
                continue
            if beat.published <= cutoff - stale_for:
                stale += 1
                continue
            holds_until = min(holds_until, beat.published + stale_for)
            dropped += beat.dropped
            for identity, until in beat.unknown:
                if until > cutoff:
                    unknown.add(identity)
                    holds_until = min(holds_until, until)
            for identity, reports, relabels in beat.callers:
                counts = callers.setdefault(identity, [0, 0])
                counts[0] += reports
                counts[1] += relabels
            for index in sorted(beat.shards.keys() | process.shards.keys()):
                listed = beat.shards.get(index)
                found = process.shards.get(index)
                if found is None:
                    unreadable += 1  # listed but not visible: never counted from nothing
                    continue
                parsed = self._shard(found)
                if isinstance(parsed, Exception):
                    log.warning("cannot read agent reports %s: %s", found.where, parsed)
                    unreadable += 1
                elif found.generation == listed or parsed.written >= beat.published:
                    wanted[found.where] = (found.generation, parsed)
                elif listed is not None:
                    unreadable += 1  # an older text than the heartbeat vouches for
                # else: a leftover shard (beyond the count) the heartbeat no longer lists
        changed = self._apply(wanted)
        seen = {s.where for p in processes for s in p.shards.values()}
        for where in [w for w in self._parsed if w not in seen]:
            del self._parsed[where]
        for where in [w for w in self._heartbeats if w not in {p.where for p in processes}]:
            del self._heartbeats[where]
        if changed:
            self._entries = dict(self._latest)
        key = (tuple(signature), tuple(sorted(self._counted.items())), dropped, unreadable, stale)
        if not changed and self._result is not None:
            last_key, last_holds, last = self._result
            if last_key == key and cutoff < last_holds:
                return last
        result = FleetReports.merged(self._entries, unknown, (dropped, unreadable, stale), callers)
        self._result = (key, holds_until, result)
        return result

    def _apply(self, wanted: dict[str, tuple[str, ParsedShard]]) -> bool:
        """Moves `_candidates` from the shards counted last round to `wanted`, re-deciding only
        the pods whose entry changed (an unchanged entry is the same object, `parse_shard`).
        Whether any pod's winning entry changed."""
        touched: set[str] = set()
        candidates = self._candidates
        for where in [w for w in self._counted if w not in wanted]:
            for key in self._counted_entries.pop(where):
                _drop(candidates, key, where)
                touched.add(key)
            del self._counted[where]
        for where, (generation, parsed) in wanted.items():
            if self._counted.get(where) == generation:
                continue
            old = self._counted_entries.get(where, {})
            new = parsed.entries
            for key, entry in old.items():
                if new.get(key) is not entry:
                    _drop(candidates, key, where)
                    touched.add(key)
            for key, entry in new.items():
                if old.get(key) is not entry:
                    candidates.setdefault(key, {})[where] = entry
                    touched.add(key)
            self._counted[where] = generation
            self._counted_entries[where] = new
        changed = False
        for key in touched:
            copies = candidates.get(key)
            best = max(copies.values(), key=_newest) if copies else None
            if best is None:
                changed = self._latest.pop(key, None) is not None or changed
            elif self._latest.get(key) is not best:
                self._latest[key] = best
                changed = True
        return changed


def _drop(candidates: dict[str, dict[str, FleetEntry]], key: str, where: str) -> None:
    copies = candidates.get(key)
    if copies is not None:
        copies.pop(where, None)
        if not copies:
            del candidates[key]


def _newest(entry: FleetEntry) -> tuple[float, str]:
    """The winning copy of a pod's entry: the largest `since`; ties broken the same way in
    every reader."""
    return (entry.refreshed, entry.bundle or "")
