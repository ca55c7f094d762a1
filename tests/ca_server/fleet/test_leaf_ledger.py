"""The live-leaf ledger: never under-counts, forgets what expired, and adds up every process."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.leaf_ledger import LEDGER_DIR, DirectoryLedgerSink, LeafLedger

NOW = datetime(2030, 1, 1, 12, 0, 0, 500_000, tzinfo=UTC)


def test_counts_until_expiry_rounded_up_never_down():
    ledger = LeafLedger()
    ledger.record("a", NOW + timedelta(seconds=3), NOW)
    ledger.record("a", NOW + timedelta(hours=5), NOW)
    ledger.record("b", NOW + timedelta(minutes=30), NOW)
    assert ledger.live(NOW) == {"a": 2, "b": 1}
    # Still counted up to its bucket's end (5 s near expiry), never dropped early.
    assert ledger.live(NOW + timedelta(seconds=3)) == {"a": 2, "b": 1}
    assert ledger.live(NOW + timedelta(seconds=10)) == {"a": 1, "b": 1}
    assert ledger.live(NOW + timedelta(hours=2)) == {"a": 1, "b": 0}
    assert set(json.loads(ledger.snapshot_json(NOW + timedelta(hours=2)))) == {"a"}


def test_every_process_snapshot_counts_and_spent_ones_are_swept(tmp_path: Path):
    for instance, count in (("ca-1", 2), ("ca-2", 3)):
        ledger = LeafLedger()
        for _ in range(count):
            ledger.record("a", NOW + timedelta(minutes=20), NOW)
        DirectoryLedgerSink(tmp_path, instance).save(ledger, AgentReports(), NOW)
    reader = DirectoryLedgerSink(tmp_path, "meshca-authority")
    assert reader.live(NOW) == {"a": 5}
    (tmp_path / LEDGER_DIR / "garbage.json").write_text("{not json")
    assert reader.live(NOW) == {"a": 5}, "an unreadable snapshot is skipped"

    later = NOW + timedelta(hours=1)
    survivor = LeafLedger()
    survivor.record("b", later + timedelta(minutes=5), later)
    DirectoryLedgerSink(tmp_path, "ca-3").save(survivor, AgentReports(), later)
    names = sorted(p.name for p in (tmp_path / LEDGER_DIR).glob("*.json"))
    assert names == ["ca-3.json", "garbage.json"], "spent snapshots of gone processes are swept"
    assert reader.live(later) == {"b": 1}


def test_bucket_width_by_time_left_and_never_before_the_expiry():
    """5 s buckets up to 10 minutes left, a minute up to an hour, else an hour; the bucket
    ends at or after NotAfter (rounded up), within one width of it."""
    from ca_server.fleet.leaf_ledger import _bucket

    for left, width in ((1, 5), (600, 5), (601, 60), (3600, 60), (3601, 3600), (86400, 3600)):
        not_after = NOW + timedelta(seconds=left)  # NOW is half a second past a whole one
        end = _bucket(not_after, NOW)
        assert end % width == 0, (left, end)
        assert not_after.timestamp() <= end < not_after.timestamp() + width, (left, end)
    on_the_edge = NOW.replace(microsecond=0) + timedelta(minutes=20)  # a whole bucket end
    assert _bucket(on_the_edge, NOW) == on_the_edge.timestamp()
