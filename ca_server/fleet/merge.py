"""Every CA process's published agent reports merged into the one figure readers count.

Each process publishes its table (`ca_server.fleet.agent_reports`) as a JSON snapshot; a reader
(the activation gate, the plugged-in guard, `meshca authority show`, `meshca status`) merges
every snapshot: per pod the most recently refreshed entry wins (replicas' clocks are assumed to
agree far better than an agent's report interval), and entries of pods the informer says are
gone are left out (`without_gone_pods`). A snapshot older than `STALE_AFTER` belongs to a
process that is gone and stops counting; one of an older format (keyed on caller-chosen ids)
never counts; one that cannot be read is counted as *unreadable* (and warned about), so no
figure claims to be complete. `SnapshotCache` parses each snapshot once per distinct text and
keeps the last merge while nothing changed or expired. `is_spent` says when a gone process's
snapshot no longer counts for anything (its file may be swept).

In Kubernetes mode the snapshot is sharded and its liveness is a separate heartbeat, so routine
re-reports write nothing (`ca_server.fleet.report_shards`, which merges shards by the same
rules).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from ca_server.fleet.entries import (
    SNAPSHOT_FORMAT,
    STALE_AFTER,
    FleetEntry,
    FleetReports,
    Instance,
    PodWatch,
    split_published,
)

log = logging.getLogger(__name__)


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
    for key, fields in agents.items():
        counted, jwt_keys = split_published(fields, times=2)
        identity, label, bundle, authority, node, refreshed, until = counted
        entry = FleetEntry.decoded(
            key, identity, label, bundle, authority, node, refreshed, jwt_keys
        )
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
    keyed = [(key, entry, Instance.from_key(key)) for key, entry in fleet.entries.items()]
    verdicts = iter(pods.verdicts([instance for _, _, instance in keyed if instance is not None]))
    entries = {
        key: entry
        for key, entry, instance in keyed
        if instance is None or next(verdicts).live is not False
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
