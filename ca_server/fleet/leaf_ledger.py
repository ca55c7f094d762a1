"""How many live leaves each authority has signed — the figure that says when an old root may go.

A leaf stays live until its NotAfter whether or not the process that signed it is still running,
so the ledger records expiries, not events: per authority, a count per expiry bucket. Buckets are
rounded *up* (to 5 s for leaves ending within 10 minutes, a minute within the hour, else an
hour), so a count can be slightly high for up to one bucket, never low, and the size stays
bounded (at most 120 + 60 + 24 * 90 buckets per authority for the longest TTL).

Each CA process keeps its own `LeafLedger` (the signer records into it on the event loop) and a
`LedgerSink` publishes its snapshot where the others and `meshca authority show` find it: one
file per process in `--data-dir/leaves/` (`DirectoryLedgerSink`), or one ConfigMap per replica
in Kubernetes mode (`ca_server.kube.replica_reports`). Readers sum every snapshot; snapshots of
processes that are gone still count until their leaves expire — that is the point — and are
swept once they are spent.

Agent reports (which bundle an agent trusts, `ca_server.fleet.agent_reports`) travel the same
way: the server hands this process's `AgentReports` table to the authority driver, whose sink
publishes it beside the leaf snapshot (`data_dir/agents/<instance>.json`, or the replica
ConfigMap's `agents.json`); readers merge them (`LedgerSink.agents`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Protocol

from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.entries import FleetReports
from ca_server.fleet.merge import is_spent as agents_spent
from ca_server.fleet.merge import merge_snapshots
from meshca.files import atomic_write, ensure_dir

log = logging.getLogger(__name__)

LEDGER_DIR = "leaves"
AGENTS_DIR = "agents"
# (leaves ending within this many seconds, bucket width in seconds): finer near expiry, where
# it matters.
_STEPS = ((10 * 60, 5), (60 * 60, 60))
_COARSE = 3600


def _bucket(not_after: datetime, now: datetime) -> int:
    """The end of `not_after`'s bucket (unix seconds). In seconds, not timedeltas: the signer
    calls this for every leaf."""
    end = not_after.timestamp()
    left = end - now.timestamp()
    step = _COARSE
    for horizon, width in _STEPS:
        if left <= horizon:
            step = width
            break
    return math.ceil(end / step) * step


class LeafLedger:
    """Per authority ID: {bucket end (unix seconds): leaves expiring by then}."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, Counter[int]] = {}
        self.changed = False

    def record(self, authority: str, not_after: datetime, now: datetime) -> None:
        bucket = _bucket(not_after, now)
        with self._lock:
            buckets = self._buckets.get(authority)
            if buckets is None:
                buckets = self._buckets[authority] = Counter()
            buckets[bucket] += 1
            self.changed = True

    def live(self, now: datetime) -> dict[str, int]:
        cutoff = now.timestamp()
        with self._lock:
            return {
                authority: sum(n for end, n in buckets.items() if end > cutoff)
                for authority, buckets in self._buckets.items()
            }

    def prune(self, now: datetime) -> None:
        cutoff = now.timestamp()
        with self._lock:
            for authority in list(self._buckets):
                kept = Counter({e: n for e, n in self._buckets[authority].items() if e > cutoff})
                if kept:
                    self._buckets[authority] = kept
                else:
                    del self._buckets[authority]

    def snapshot_json(self, now: datetime) -> str:
        """The unexpired buckets as JSON (what a sink publishes); clears `changed`."""
        self.prune(now)
        with self._lock:
            self.changed = False
            snapshot = {a: {str(e): n for e, n in b.items()} for a, b in self._buckets.items()}
        return json.dumps(snapshot, sort_keys=True)


def sum_snapshots(snapshots: Iterable[tuple[str, str]], now: datetime) -> dict[str, int]:
    """Live leaves per authority over `(where, snapshot JSON)` pairs; unreadable ones are
    skipped with a warning naming `where`."""
    totals: Counter[str] = Counter()
    cutoff = now.timestamp()
    for where, text in snapshots:
        try:
            for authority, buckets in json.loads(text).items():
                totals[authority] += sum(n for e, n in buckets.items() if int(e) > cutoff)
        except (ValueError, AttributeError, TypeError) as exc:
            log.warning("ignoring unreadable leaf ledger %s: %s", where, exc)
    return dict(totals)


def is_spent(text: str, now: datetime) -> bool:
    """True when a snapshot holds no leaf that is still live (or cannot be read at all)."""
    try:
        return all(int(e) <= now.timestamp() for b in json.loads(text).values() for e in b)
    except (ValueError, AttributeError, TypeError):
        return False  # not ours to judge: left alone


class LedgerSink(Protocol):
    """Where a CA process publishes its ledger and reads everybody's."""

    def save(self, ledger: LeafLedger, agents: AgentReports, now: datetime) -> None:
        """Publishes `ledger` and `agents` (each if it changed or is due), and sweeps spent
        snapshots of gone processes. Blocking (a worker thread); failures are logged, never
        raised."""
        ...

    def live(self, now: datetime) -> dict[str, int]:
        """Live leaves per authority, summed over every process's snapshot."""
        ...

    def agents(self, now: datetime) -> FleetReports:
        """Every process's agent reports, merged."""
        ...

    def figures(self, now: datetime) -> tuple[dict[str, int], FleetReports]:
        """`live` and `agents` from one read of the published snapshots (a driver round
        wants both; in Kubernetes mode that is one list call instead of two)."""
        ...


class DirectoryLedgerSink:
    """One file per process in `data_dir/leaves/` (shared by the processes on one host)."""

    def __init__(self, data_dir: Path, instance: str) -> None:
        self._directory = data_dir / LEDGER_DIR
        self._agents_directory = data_dir / AGENTS_DIR
        self._own = f"{instance}.json"

    def save(self, ledger: LeafLedger, agents: AgentReports, now: datetime) -> None:
        agents.prune(now)
        try:
            if ledger.changed:
                ensure_dir(self._directory)
                atomic_write(self._directory / self._own, ledger.snapshot_json(now))
                self._sweep(self._directory, is_spent, now)
            if agents.due(now):
                ensure_dir(self._agents_directory)
                atomic_write(self._agents_directory / self._own, agents.snapshot_json(now))
                self._sweep(self._agents_directory, agents_spent, now)
        except OSError as exc:
            log.warning("could not save the leaf ledger in %s: %s", self._directory, exc)

    def _sweep(
        self, directory: Path, spent: Callable[[str, datetime], bool], now: datetime
    ) -> None:
        for path in directory.glob("*.json"):
            if path.name == self._own:
                continue
            try:
                if spent(path.read_text(), now):
                    path.unlink()
            except OSError:
                continue

    def live(self, now: datetime) -> dict[str, int]:
        return sum_snapshots(_read_all(self._directory), now)

    def agents(self, now: datetime) -> FleetReports:
        return merge_snapshots(_read_all(self._agents_directory), now)

    def figures(self, now: datetime) -> tuple[dict[str, int], FleetReports]:
        return self.live(now), self.agents(now)  # two directories: nothing to share


def _read_all(directory: Path) -> list[tuple[str, str]]:
    """(path, text) of every snapshot in `directory`; unreadable ones skipped with a warning."""
    snapshots = []
    for path in sorted(directory.glob("*.json")):
        try:
            snapshots.append((str(path), path.read_text()))
        except OSError as exc:
            log.warning("ignoring unreadable snapshot %s: %s", path, exc)
    return snapshots
