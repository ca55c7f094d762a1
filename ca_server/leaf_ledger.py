"""How many live leaves each authority has signed — the figure that says when an old root may go.

A leaf stays live until its NotAfter whether or not the process that signed it is still running,
so the ledger records expiries, not events: per authority, a count per expiry bucket. Buckets are
rounded *up* (to 5 s for leaves ending within 10 minutes, a minute within the hour, else an
hour), so a count can be slightly high for up to one bucket, never low, and the size stays
bounded (at most 120 + 60 + 24 * 90 buckets per authority for the longest TTL).

Each CA process keeps its own `LeafLedger` (the signer records into it on the event loop) and
saves a snapshot as `leaves/<instance>.json` in the data directory; `live_leaves_in` sums every
process's snapshot, which is what `meshca authority show` prints. Snapshots of processes that
are gone still count until their leaves expire — that is the point.

Agent reports (which bundle an agent trusts, which authority signed the leaf it serves) are the
next step (they need the agent pipeline); they will be kept the same way, one snapshot per CA
process keyed by agent, summed by the reader.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

from meshca.files import atomic_write, ensure_dir

log = logging.getLogger(__name__)

LEDGER_DIR = "leaves"
# (leaves ending within, bucket width in seconds): finer near expiry, where it matters.
_STEPS = ((timedelta(minutes=10), 5), (timedelta(hours=1), 60))
_COARSE = 3600


def _bucket(not_after: datetime, now: datetime) -> int:
    left = not_after - now
    step = next((width for horizon, width in _STEPS if left <= horizon), _COARSE)
    return math.ceil(not_after.timestamp() / step) * step


class LeafLedger:
    """Per authority ID: {bucket end (unix seconds): leaves expiring by then}."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, Counter[int]] = {}
        self.changed = False

    def record(self, authority: str, not_after: datetime, now: datetime) -> None:
        with self._lock:
            self._buckets.setdefault(authority, Counter())[_bucket(not_after, now)] += 1
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

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            self.changed = False
            return {a: {str(e): n for e, n in b.items()} for a, b in self._buckets.items()}

    def save(self, data_dir: Path, instance: str, now: datetime) -> None:
        """Writes this process's snapshot (atomically) when something changed since the last."""
        if not self.changed:
            return
        self.prune(now)
        directory = ensure_dir(data_dir / LEDGER_DIR)
        atomic_write(directory / f"{instance}.json", json.dumps(self.snapshot(), sort_keys=True))
        sweep_spent(directory, now, keep=f"{instance}.json")


def sweep_spent(directory: Path, now: datetime, keep: str) -> None:
    """Deletes snapshots left by processes that are gone and whose leaves have all expired (an
    empty snapshot of a live process is rewritten, and re-created at its next signature)."""
    for path in directory.glob("*.json"):
        if path.name == keep:
            continue
        try:
            buckets = json.loads(path.read_text())
            spent = all(int(e) <= now.timestamp() for b in buckets.values() for e in b)
            if spent:
                path.unlink()
        except (OSError, ValueError, AttributeError):
            continue


def live_leaves_in(data_dir: Path, now: datetime) -> dict[str, int]:
    """Live leaves per authority across every process's saved snapshot in `data_dir`."""
    totals: Counter[str] = Counter()
    cutoff = now.timestamp()
    for path in sorted((data_dir / LEDGER_DIR).glob("*.json")):
        try:
            snapshot = json.loads(path.read_text())
            for authority, buckets in snapshot.items():
                totals[authority] += sum(n for e, n in buckets.items() if int(e) > cutoff)
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("ignoring unreadable leaf ledger %s: %s", path, exc)
    return dict(totals)
