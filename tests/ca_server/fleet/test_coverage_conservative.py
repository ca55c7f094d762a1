"""Issue #17 "conservative by construction": what the CA could not see counts as not trusting for
activation (the self-signed gate and the plugged-in guard) and as maybe serving for revoke, and
the plugged-in guard, like the gate, gives up waiting at `--activate-deadline` and says so.
Time is injected: nothing sleeps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ca_server.authority.plugged import PluggedChangeGuard, StrandingChangeError
from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.coverage import AgentCoverage
from ca_server.fleet.leaf_ledger import DirectoryLedgerSink, LeafLedger
from certs import SigningAuthority
from certs.bundle import bundle_digest
from tests.support.agent_reports import pod_caller
from tests.support.pki import TestCa

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def test_unseen_agents_count_as_not_trusting_and_an_unreadable_report_holds_the_gate() -> None:
    assert AgentCoverage(95, 100).reaches(0.95)
    assert not AgentCoverage(95, 100, unseen=5).reaches(0.95)  # 95/105
    assert not AgentCoverage(100, 100, unreadable=1).reaches(0.5)
    assert not AgentCoverage(0, 0, unseen=1).reaches(0.1), "nothing seen is not nothing there"
    assert AgentCoverage(0, 0).reaches(0.95)
    assert str(AgentCoverage(95, 100, unseen=5)) == (
        "95/105 reporting agents trust it, 5 unseen counted as not trusting"
    )


def _authority(ca: TestCa, roots: list[TestCa]) -> SigningAuthority:
    return SigningAuthority(
        cert=ca.cert,
        key=ca.key,
        intermediates=tuple(ca.intermediates[1:]),
        roots=tuple(r.root for r in roots),
    )


def test_the_plugged_in_guard_waits_for_coverage_until_its_deadline(tmp_path: Path) -> None:
    a = TestCa(NOW - timedelta(days=1), lifetime=timedelta(days=30))
    b = TestCa(NOW - timedelta(days=1), lifetime=timedelta(days=30))
    ia = a.child_ca(lifetime=timedelta(days=11))  # expires 10 days after NOW
    ib = b.child_ca(lifetime=timedelta(days=30))
    current, moved = _authority(ia, [a, b]), _authority(ib, [a, b])
    ledger = LeafLedger()
    agents = AgentReports()
    deadlines: list[int] = []
    guard = PluggedChangeGuard(
        ledger,
        agents,
        DirectoryLedgerSink(tmp_path, "ca-1"),
        switch_at_coverage=0.95,
        deadline_share=0.5,
        on_deadline=lambda: deadlines.append(1),
    )
    both, old = bundle_digest([a.root, b.root]), bundle_digest([a.root])
    agents.record_report(pod_caller("p1"), "x", both, [], NOW)
    agents.record_report(pod_caller("p2"), "y", old, [], NOW)
    with pytest.raises(StrandingChangeError, match="only 1/2 reporting agents trust it"):
        guard.check(current, moved, NOW)
    # Waits at most half of the current signing certificate's remaining 10 days.
    later = NOW + timedelta(days=4, hours=23)
    agents.record_report(pod_caller("p2"), "y", old, [], later)
    agents.record_report(pod_caller("p1"), "x", both, [], later)
    with pytest.raises(StrandingChangeError, match=r"or anyway at 2026-12-06"):
        guard.check(current, moved, later)
    assert deadlines == []
    at_deadline = NOW + timedelta(days=5)
    agents.record_report(pod_caller("p2"), "y", old, [], at_deadline)
    agents.record_report(pod_caller("p1"), "x", both, [], at_deadline)
    guard.check(current, moved, at_deadline)  # taken (still at 1/2), loudly
    assert deadlines == [1]


def test_the_guard_counts_a_report_it_could_not_read_as_not_covered(tmp_path: Path) -> None:
    a = TestCa(NOW - timedelta(days=1), lifetime=timedelta(days=30))
    b = TestCa(NOW - timedelta(days=1), lifetime=timedelta(days=30))
    current = _authority(a.child_ca(lifetime=timedelta(days=11)), [a, b])
    moved = _authority(b.child_ca(lifetime=timedelta(days=11)), [a, b])
    ledger = LeafLedger()
    agents = AgentReports()
    guard = PluggedChangeGuard(ledger, agents, DirectoryLedgerSink(tmp_path, "ca-1"), 0.5)
    agents.record_report(pod_caller("p1"), "x", bundle_digest([a.root, b.root]), [], NOW)
    (tmp_path / "agents").mkdir(exist_ok=True)
    (tmp_path / "agents" / "ca-2.json").write_text("{not json")
    with pytest.raises(StrandingChangeError, match="1 report\\(s\\) unreadable"):
        guard.check(current, moved, NOW)
    (tmp_path / "agents" / "ca-2.json").unlink()
    guard.check(current, moved, NOW)  # 1/1 once every report can be read
