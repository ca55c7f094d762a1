"""The parts workers publish for `/debug/ca` and the supervisor's merge of them (real
certificates, real files; the processes themselves: test_workers.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.authority.report import AuthorityReport, status_section
from ca_server.authority.signer import LocalSigner
from ca_server.authority.slots import AuthorityState, Phase
from ca_server.authority.state_store import SlotFactory
from ca_server.fleet.entries import FleetEntry, FleetReports
from ca_server.fleet.issued_leaves import IssuedLeaf, IssuedLeaves
from ca_server.serving.status import ca_document
from ca_server.serving.worker_status import (
    WorkerStatusPublisher,
    decode_part,
    encode_part,
    merged_document,
)
from certs import KeySpec, SigningAuthority, new_self_signed_authority
from meshca.clock import FakeClock

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _authority(days: int) -> SigningAuthority:
    return new_self_signed_authority(
        KeySpec(), "cluster.local", now=NOW - timedelta(days=1), lifetime=timedelta(days=days)
    )


def _leaf(identity: str, serial: str, issued_minutes_ago: int, hours_left: int) -> IssuedLeaf:
    return IssuedLeaf(
        identity,
        serial,
        NOW - timedelta(minutes=issued_minutes_ago),
        NOW + timedelta(hours=hours_left),
    )


def _write(path: Path, authority: SigningAuthority, leaves: list[IssuedLeaf], at: datetime) -> Path:
    path.write_text(encode_part(authority, leaves, at))
    return path


def test_a_part_round_trips_the_public_chain_and_the_leaves():
    authority = _authority(30)
    leaves = [_leaf("spiffe://cluster.local/ns/a/sa/x", "1f", 5, 10)]
    part = decode_part(encode_part(authority, leaves, NOW))
    assert part.written_at == NOW
    assert part.chain.cert == authority.cert and part.chain.roots == authority.roots
    assert part.chain.not_after == authority.not_after
    assert part.leaves == leaves
    assert "PRIVATE KEY" not in encode_part(authority, leaves, NOW)


def test_the_merge_shows_the_newest_authority_and_the_latest_leaf_per_identity(tmp_path: Path):
    old, new = _authority(30), _authority(60)
    renewed = "spiffe://cluster.local/ns/a/sa/renewed"
    first = _write(
        tmp_path / "debug-ca-0.json",
        new,
        [_leaf(renewed, "new", 1, 24), _leaf("spiffe://cluster.local/ns/a/sa/b", "b", 3, 5)],
        NOW,
    )
    second = _write(
        tmp_path / "debug-ca-1.json",
        old,
        [_leaf(renewed, "stale", 60, 1), _leaf("spiffe://cluster.local/ns/a/sa/c", "c", 2, 7)],
        NOW - timedelta(seconds=1),
    )
    started = NOW - timedelta(hours=1)
    document = merged_document([second, first, tmp_path / "gone.json"], started, NOW)
    assert document is not None

    expected_leaves = IssuedLeaves()
    for leaf in (
        _leaf(renewed, "new", 1, 24),
        _leaf("spiffe://cluster.local/ns/a/sa/b", "b", 3, 5),
        _leaf("spiffe://cluster.local/ns/a/sa/c", "c", 2, 7),
    ):
        expected_leaves.record(leaf)
    assert document == {
        **ca_document(new, expected_leaves, started, NOW),
        "workers_reporting": 2,
    }
    assert [leaf["serial"] for leaf in document["soonest_expiring_leaves"]] == ["b", "c", "new"]
    assert document["certificates"][0]["serial"] == f"{new.cert.serial_number:x}"


def test_the_merge_keeps_the_single_ca_bound(tmp_path: Path):
    leaves = [
        _leaf(f"spiffe://cluster.local/ns/a/sa/s{i}", f"{i:x}", 100 - i, 1 + i) for i in range(6)
    ]
    part_a = _write(tmp_path / "a.json", _authority(30), leaves[:3], NOW)
    part_b = _write(tmp_path / "b.json", _authority(30), leaves[3:], NOW)
    document = merged_document([part_a, part_b], NOW, NOW, capacity=4)
    assert document is not None
    # The least recently issued identities are evicted first, as in one CA's `IssuedLeaves`.
    assert document["leaves_known"] == 4
    assert [leaf["serial"] for leaf in document["soonest_expiring_leaves"]] == ["2", "3", "4", "5"]


def test_an_unreadable_part_is_skipped_and_no_part_means_no_document(tmp_path: Path):
    garbage = tmp_path / "debug-ca-0.json"
    garbage.write_text("{not json")
    assert merged_document([garbage, tmp_path / "missing.json"], NOW, NOW) is None
    good = _write(tmp_path / "debug-ca-1.json", _authority(30), [], NOW)
    document = merged_document([garbage, good], NOW, NOW)
    assert document is not None and document["workers_reporting"] == 1
    assert document["leaves_known"] == 0


def test_the_publisher_writes_at_once_on_a_new_authority_and_at_most_once_per_interval(
    tmp_path: Path,
):
    clock = FakeClock(NOW)
    signer = LocalSigner(_authority(30))
    leaves = IssuedLeaves()
    path = tmp_path / "debug-ca-0.json"
    publisher = WorkerStatusPublisher(path, lambda: signer.authority, leaves, clock, interval=1.0)
    assert publisher.due()
    publisher.publish()
    assert not publisher.due()
    assert decode_part(path.read_text()).leaves == []

    leaves.record(_leaf("spiffe://cluster.local/ns/a/sa/x", "1", 0, 1))
    assert not publisher.due(), "throttled: less than an interval since the last write"
    clock.advance(1.0)
    assert publisher.due()
    publisher.publish()
    assert [leaf.serial_hex for leaf in decode_part(path.read_text()).leaves] == ["1"]
    clock.advance(5.0)
    assert not publisher.due(), "nothing changed: no rewrite"

    rotated = _authority(60)
    signer.replace(rotated)
    assert publisher.due(), "a new authority is published without waiting"
    publisher.publish()
    assert decode_part(path.read_text()).chain.cert == rotated.cert

    publisher.remove()
    assert not path.exists()


def _state(*phases: Phase) -> AuthorityState:
    factory = SlotFactory(KeySpec(), "cluster.local", timedelta(days=30))
    return AuthorityState(tuple(factory.new(NOW, phase) for phase in phases))


def test_the_publisher_writes_again_when_the_slots_change(tmp_path: Path):
    clock = FakeClock(NOW)
    path = tmp_path / "debug-ca-0.json"
    state = _state(Phase.ACTIVE, Phase.PREPARED)
    active = state.active.id
    agent = FleetEntry("/default/agent-1/u1", "spiffe://x", None, None, frozenset(), None, 0.0)
    fleet = FleetReports({agent.key: agent}, frozenset())
    report = AuthorityReport()
    report.update(state, {}, fleet, NOW)
    signer = LocalSigner(state.signing_authority())
    publisher = WorkerStatusPublisher(
        path, lambda: signer.authority, IssuedLeaves(), clock, slots=lambda: report.snapshot
    )
    publisher.publish()
    assert not publisher.due()

    report.update(state, {}, fleet, NOW + timedelta(seconds=1))
    assert not publisher.due(), "the same section: nothing to write"
    report.update(state, {active: 3}, fleet, NOW + timedelta(seconds=2))
    assert publisher.due(), "new figures are published without waiting for a leaf"
    publisher.publish()
    part = decode_part(path.read_text())
    assert part.slots == status_section(state, {active: 3}, fleet)
    assert part.slots_changed_at == NOW + timedelta(seconds=2)
    assert part.slots is not None and part.slots["authorities"][0]["live_leaves"] == 3


def test_the_merge_shows_the_slots_that_changed_last(tmp_path: Path):
    """Workers converge on the same slots; the one that saw the latest change wins, whichever
    wrote its part last (a leaf issued on a lagging worker rewrites its part, not its view)."""
    before = _state(Phase.ACTIVE)
    after = AuthorityState((*before.slots, _state(Phase.PREPARED).slots[0]))
    fleet = FleetReports({}, frozenset())
    lagging, current = AuthorityReport(), AuthorityReport()
    lagging.update(before, {}, fleet, NOW - timedelta(seconds=5))
    current.update(after, {}, fleet, NOW - timedelta(seconds=2))
    authority = before.signing_authority()
    parts = [tmp_path / "debug-ca-0.json", tmp_path / "debug-ca-1.json"]
    parts[0].write_text(encode_part(authority, [], NOW, lagging.snapshot))
    parts[1].write_text(encode_part(authority, [], NOW - timedelta(seconds=1), current.snapshot))
    document = merged_document(parts, NOW, NOW)
    assert document is not None
    assert [row["state"] for row in document["authorities"]] == ["active", "prepared"]
    assert document["coverage"] == status_section(after, {}, fleet)["coverage"]

    # A plugged-in CA's workers have no slots: the document says so with nulls.
    parts[1].write_text(encode_part(authority, [], NOW))
    parts[0].write_text(encode_part(authority, [], NOW))
    document = merged_document(parts, NOW, NOW)
    assert document is not None
    assert document["authorities"] is None and document["coverage"] is None
