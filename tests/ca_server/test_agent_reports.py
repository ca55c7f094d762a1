"""The CA's per-process table of agent reports and the coverage rule (`ca_server.agent_reports`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509

from agent import trust_bundle
from ca_server.agent_reports import (
    AGENT_ID_HEADER,
    LEAF_AUTHORITY_HEADER,
    TRUST_BUNDLE_HEADER,
    AgentReports,
    FleetReports,
    bundle_digest,
    coverage,
    is_spent,
    merge_snapshots,
)
from ca_server.leaf_ledger import DirectoryLedgerSink, LeafLedger
from certs import KeySpec, new_self_signed_authority

NOW = datetime(2026, 12, 1, 4, 0, tzinfo=UTC)
DIGEST = "ab" * 32


def _root() -> x509.Certificate:
    return new_self_signed_authority(
        KeySpec(), "cluster.local", now=NOW, lifetime=timedelta(days=1)
    ).roots[0]


def _report(agent: str, digest: str | None = DIGEST) -> dict[str, str]:
    headers = {AGENT_ID_HEADER: agent}
    if digest is not None:
        headers[TRUST_BUNDLE_HEADER] = digest
    return headers


def test_the_digest_is_the_agents_own() -> None:
    """One definition (`certs.bundle`) for both sides, so the CA's comparison cannot drift."""
    assert bundle_digest is trust_bundle.bundle_digest


def test_malformed_headers_are_ignored_and_a_missing_id_is_an_unknown_caller() -> None:
    reports = AgentReports()
    reports.record(_report("pod-1", "NOT-HEX"), "spiffe://x/ns/a/sa/a", NOW)
    reports.record({**_report("pod-2"), LEAF_AUTHORITY_HEADER: "zz"}, "spiffe://x/ns/a/sa/a", NOW)
    reports.record({AGENT_ID_HEADER: "bad id with spaces"}, "spiffe://x/ns/a/sa/b", NOW)
    reports.record({AGENT_ID_HEADER: "x" * 300}, "spiffe://x/ns/a/sa/c", NOW)
    reports.record({}, "spiffe://x/ns/a/sa/b", NOW)
    fleet = merge_snapshots([("own", reports.snapshot_json(NOW))], NOW)
    assert fleet.bundles == {"pod-1": None, "pod-2": DIGEST}
    assert fleet.unknown == {"spiffe://x/ns/a/sa/b", "spiffe://x/ns/a/sa/c"}


def test_the_table_is_bounded_and_entries_expire() -> None:
    reports = AgentReports(expire_after=timedelta(minutes=10), capacity=3)
    for n in range(5):
        reports.record(_report(f"pod-{n}"), "caller", NOW + timedelta(minutes=n))
    later = NOW + timedelta(minutes=12, seconds=30)  # pod-0..2 seen > 10 min before
    fleet = merge_snapshots([("own", reports.snapshot_json(later))], later)
    assert set(fleet.bundles) == {"pod-3", "pod-4"}  # pod-0, pod-1 evicted; pod-2 expired
    assert not is_spent(reports.snapshot_json(later), later)
    assert is_spent(reports.snapshot_json(later), NOW + timedelta(hours=1))


def test_merging_keeps_each_agents_latest_report_and_skips_garbage() -> None:
    old, new = AgentReports(), AgentReports()
    old.record(_report("pod-1", "11" * 32), "caller", NOW)
    new.record(_report("pod-1", "22" * 32), "caller", NOW + timedelta(seconds=5))
    snapshots = [("new", new.snapshot_json(NOW)), ("old", old.snapshot_json(NOW)), ("bad", "[")]
    fleet = merge_snapshots(snapshots, NOW)
    assert fleet.bundles == {"pod-1": "22" * 32}


def test_coverage_counts_an_agent_only_for_the_authorities_its_bundle_holds() -> None:
    a, b = _root(), _root()
    fleet = FleetReports(
        {
            "new": bundle_digest([a, b]),
            "held": bundle_digest([a]),
            "stranger": bundle_digest([_root()]),  # a bundle the CA knows nothing of
            "empty": None,
        },
        frozenset({"istio"}),
    )
    result = coverage([("A", a), ("B", b)], fleet)
    assert result.trusting == {"A": 2, "B": 1}
    assert (result.reporting, result.unknown) == (4, 1)


def test_the_directory_sink_publishes_reports_beside_the_ledger(tmp_path: Path) -> None:
    mine, gone = LeafLedger(), LeafLedger()
    mine.agents.record(_report("pod-1"), "caller", NOW)
    gone.agents.expire_after = timedelta(seconds=1)
    gone.agents.record(_report("pod-2"), "caller", NOW)
    DirectoryLedgerSink(tmp_path, "gone").save(gone, NOW)
    sink = DirectoryLedgerSink(tmp_path, "mine")
    sink.save(mine, NOW)
    assert set(sink.agents(NOW).bundles) == {"pod-1", "pod-2"}
    assert not mine.agents.changed
    later = NOW + timedelta(minutes=1)
    mine.agents.record(_report("pod-3"), "caller", later)
    sink.save(mine, later)  # sweeps the gone process's spent report
    assert sorted(p.name for p in (tmp_path / "agents").iterdir()) == ["mine.json"]
    assert set(sink.agents(later).bundles) == {"pod-1", "pod-3"}


def test_a_size_limited_snapshot_keeps_the_most_recent_and_counts_the_rest() -> None:
    reports = AgentReports()
    for n in range(100):
        reports.record(_report(f"pod-{n:03}"), "caller", NOW + timedelta(seconds=n))
    text = reports.snapshot_json(NOW, max_bytes=4096)
    assert len(text) <= 4096 + 100
    fleet = merge_snapshots([("own", text)], NOW)
    assert 0 < len(fleet.bundles) < 100 and fleet.dropped == 100 - len(fleet.bundles)
    assert "pod-099" in fleet.bundles and "pod-000" not in fleet.bundles
    assert merge_snapshots([("own", reports.snapshot_json(NOW))], NOW).dropped == 0


def test_serving_follows_the_leaves_each_agent_serves_never_undercounting() -> None:
    """`agents_serving`: what `revoke` would break. A pod agent's answered CSR moves it from the
    renewed leaf's authority to the signing one; a node agent (impersonating) keeps both until
    its next periodic report, since its other identities may still hold the old one."""
    old, new = "aa" * 20, "bb" * 20
    roots = [(old, _root()), (new, _root())]
    reports = AgentReports()
    reports.record_periodic("pod", DIGEST, [old], NOW)
    reports.record_periodic("node", DIGEST, [old], NOW)
    for agent in ("pod", "node"):
        reports.record({**_report(agent), LEAF_AUTHORITY_HEADER: old}, "spiffe://x", NOW)

    def serving() -> dict[str, int]:
        fleet = merge_snapshots([("own", reports.snapshot_json(NOW))], NOW)
        return coverage(roots, fleet).serving

    assert serving() == {old: 2, new: 0}  # a CSR names only the renewed leaf: nothing moves yet
    reports.record_issued({**_report("pod"), LEAF_AUTHORITY_HEADER: old}, new, sole_leaf=True)
    reports.record_issued({**_report("node"), LEAF_AUTHORITY_HEADER: old}, new, sole_leaf=False)
    assert serving() == {old: 1, new: 2}
    reports.record_periodic("node", DIGEST, [new], NOW)
    assert serving() == {old: 0, new: 2}
    # A first CSR (no leaf yet) from an agent never seen, and a caller with no agent id.
    reports.record(_report("fresh"), "spiffe://y", NOW)
    reports.record_issued(_report("fresh"), new, sole_leaf=True)
    reports.record_issued({}, old, sole_leaf=True)
    assert serving() == {old: 0, new: 3}
