"""The CA's per-process table of agent reports and the coverage rule
(`ca_server.fleet.agent_reports`): keyed on the pod the credential proves, expiring by the
stated rule, conservative about what it cannot see. Time is injected (`now`): nothing here
sleeps."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509

from agent import trust_bundle
from ca_server.authn import Caller
from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.coverage import authority_coverage
from ca_server.fleet.entries import (
    EXPIRE_AFTER,
    REPUBLISH_EVERY,
    STALE_AFTER,
    FleetReports,
    Instance,
    PodVerdict,
)
from ca_server.fleet.leaf_ledger import DirectoryLedgerSink, LeafLedger
from ca_server.fleet.merge import SnapshotCache, is_spent, merge_snapshots
from ca_server.wire import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER
from certs import KeySpec, SpiffeId, new_self_signed_authority
from certs.bundle import bundle_digest
from meshca.wire import MAX_REPORT_INTERVAL

NOW = datetime(2026, 12, 1, 4, 0, tzinfo=UTC)
DIGEST = "ab" * 32


def _root() -> x509.Certificate:
    return new_self_signed_authority(
        KeySpec(), "cluster.local", now=NOW, lifetime=timedelta(days=1)
    ).roots[0]


def _caller(pod: str | None = "pod-1", uid: str = "uid-1", account: str = "sleep") -> Caller:
    return Caller(
        SpiffeId("cluster.local", "default", account),
        "jwt",
        subject=f"system:serviceaccount:default:{account}",
        pod_name=pod,
        pod_uid=uid if pod is not None else None,
    )


def _headers(agent: str, digest: str | None = DIGEST) -> dict[str, str]:
    headers = {AGENT_ID_HEADER: agent}
    if digest is not None:
        headers[TRUST_BUNDLE_HEADER] = digest
    return headers


def _fleet(reports: AgentReports, now: datetime = NOW) -> FleetReports:
    return merge_snapshots([("own", reports.snapshot_json(now))], now)


def test_the_digest_is_the_agents_own() -> None:
    """One definition (`certs.bundle`) for both sides, so the CA's comparison cannot drift."""
    assert bundle_digest is trust_bundle.bundle_digest


def test_the_expiry_rule_is_a_few_report_intervals() -> None:
    """The documented rule: four of the longest report interval; a gone process's snapshot stops
    counting after one interval (with jitter) plus one republication."""
    assert EXPIRE_AFTER == 4 * MAX_REPORT_INTERVAL == timedelta(minutes=40)
    assert STALE_AFTER == MAX_REPORT_INTERVAL * 1.2 + REPUBLISH_EVERY


def test_a_report_counts_for_the_pod_its_credential_proves_not_its_agent_id() -> None:
    """Inflate: 100 made-up agent ids from one token are one entry (the pod), the last label
    winning; a caller whose credential proves no pod is one unknown identity."""
    reports = AgentReports()
    for n in range(100):
        reports.record_report(_caller("evil-0", "evil-uid"), f"forged-{n}", DIGEST, [], NOW)
    reports.record_report(_caller(None, account="istio"), "agent-x", DIGEST, [], NOW)
    reports.record_report(_caller(None, account="istio"), "agent-y", DIGEST, [], NOW)
    fleet = _fleet(reports)
    assert list(fleet.bundles) == ["/default/evil-0/evil-uid"]
    (entry,) = fleet.entries.values()
    assert entry.label == "forged-99" and entry.pod == "default/evil-0"
    assert fleet.unknown == {"spiffe://cluster.local/ns/default/sa/istio"}
    # ...and the outlier is visible: 100 reports, 99 label changes, under its identity.
    evil = fleet.callers["spiffe://cluster.local/ns/default/sa/sleep"]
    assert evil == (100, 99)


def test_malformed_values_are_ignored_and_a_csr_without_headers_is_unknown() -> None:
    reports = AgentReports()
    reports.record_csr(_caller("p1"), _headers("a1", "NOT-HEX"), "cc" * 20, sole_leaf=True, now=NOW)
    reports.record_csr(
        _caller("p2", "u2"),
        {**_headers("a2"), LEAF_AUTHORITY_HEADER: "zz"},
        "cc" * 20,
        sole_leaf=True,
        now=NOW,
    )
    reports.record_csr(
        _caller("p3", "u3", account="b"),
        {AGENT_ID_HEADER: "bad id"},
        "cc" * 20,
        sole_leaf=True,
        now=NOW,
    )
    reports.record_csr(_caller("p4", "u4", account="c"), {}, "cc" * 20, sole_leaf=True, now=NOW)
    fleet = _fleet(reports)
    assert fleet.bundles == {"/default/p1/uid-1": None, "/default/p2/u2": DIGEST}
    assert fleet.unknown == {
        "spiffe://cluster.local/ns/default/sa/b",
        "spiffe://cluster.local/ns/default/sa/c",
    }


def test_an_agent_restart_in_the_same_pod_replaces_its_entry_and_gone_pods_expire() -> None:
    """Done means 2 (local mode): 100 agent restarts in one pod are one entry at once; 100
    pods each restarted once (new tokens) leave nothing once the stated expiry has passed."""
    reports = AgentReports()
    for n in range(100):
        reports.record_report(_caller("web-0", "uid-web"), f"run-{n}", DIGEST, ["aa" * 20], NOW)
    assert len(_fleet(reports).entries) == 1
    for n in range(100):
        at = NOW + timedelta(seconds=n)
        reports.record_report(_caller(f"web-{n}", f"old-{n}"), "a", DIGEST, [], at)
        reports.record_report(_caller(f"web-{n}", f"new-{n}"), "b", DIGEST, [], at)
    assert len(_fleet(reports).entries) == 201
    # The new pods keep reporting; the old ones do not.
    later = NOW + EXPIRE_AFTER + timedelta(minutes=2)
    for n in range(100):
        reports.record_report(_caller(f"web-{n}", f"new-{n}"), "b", DIGEST, [], later)
    reports.prune(later)
    assert len(reports) == 100
    fleet = _fleet(reports, later)
    assert {e.key.rsplit("/", 1)[1] for e in fleet.entries.values()} == {
        f"new-{n}" for n in range(100)
    }


class _Pods:
    """A `PodWatch` holding the live pods' (name, uid)."""

    def __init__(self, live: set[tuple[str, str]]) -> None:
        self.live = live

    def verdict(self, instance: Instance) -> PodVerdict:
        return PodVerdict((instance.pod, instance.uid) in self.live, "node-a")

    def verdicts(self, instances: list[Instance]) -> list[PodVerdict]:
        return [self.verdict(instance) for instance in instances]


def test_a_gone_pod_stops_counting_at_once_and_records_nothing() -> None:
    pods = _Pods({("a", "1"), ("b", "2")})
    reports = AgentReports(pods=pods)
    reports.record_report(_caller("a", "1"), "x", DIGEST, [], NOW)
    reports.record_report(_caller("b", "2"), "y", DIGEST, [], NOW)
    reports.record_report(_caller("c", "3"), "z", DIGEST, [], NOW)  # not (or no longer) a pod
    assert len(reports) == 2
    assert {e.node for e in _fleet(reports).entries.values()} == {"node-a"}
    pods.live.discard(("a", "1"))
    assert reports.prune(NOW) == 1 and reports.changed
    assert [e.pod for e in _fleet(reports).entries.values()] == ["default/b"]
    # A reader with the informer drops another replica's entry of a gone pod too.
    other = AgentReports()
    other.record_report(_caller("a", "1"), "x", DIGEST, [], NOW)
    merged = merge_snapshots([("other", other.snapshot_json(NOW))], NOW, pods)
    assert merged.entries == {}


def test_merging_keeps_each_pods_latest_report_and_says_what_it_could_not_read() -> None:
    old, new = AgentReports(), AgentReports()
    old.record_report(_caller(), "a", "11" * 32, [], NOW)
    new.record_report(_caller(), "a", "22" * 32, [], NOW + timedelta(seconds=5))
    snapshots = [("new", new.snapshot_json(NOW)), ("old", old.snapshot_json(NOW)), ("bad", "[")]
    fleet = merge_snapshots(snapshots, NOW)
    assert fleet.bundles == {"/default/pod-1/uid-1": "22" * 32}
    assert fleet.unreadable == 1
    counted = authority_coverage([("A", _root())], fleet)
    assert counted.unreadable == 1


def test_a_gone_processs_snapshot_stops_counting_and_is_swept() -> None:
    gone = AgentReports()
    gone.record_report(_caller(), "a", DIGEST, [], NOW)
    text = gone.snapshot_json(NOW)
    just_before = NOW + STALE_AFTER - timedelta(seconds=1)
    assert len(merge_snapshots([("gone", text)], just_before).entries) == 1
    after = NOW + STALE_AFTER
    fleet = merge_snapshots([("gone", text)], after)
    assert (len(fleet.entries), fleet.stale) == (0, 1)
    assert not is_spent(text, just_before) and is_spent(text, after)
    # A live process republishes before that, even when nothing changed.
    assert not gone.due(NOW + REPUBLISH_EVERY - timedelta(seconds=1))
    assert gone.due(NOW + REPUBLISH_EVERY)
    # An older CA version's snapshot (keyed on caller-chosen ids) never counts.
    legacy = json.dumps({"agents": {"forged": [DIGEST, None, 9e12]}, "unknown": {}})
    assert merge_snapshots([("legacy", legacy)], NOW).entries == {}
    assert is_spent(legacy, NOW)


def test_coverage_counts_an_agent_only_for_the_authorities_its_bundle_holds() -> None:
    a, b = _root(), _root()
    reports = AgentReports()
    bundles = {
        "new": bundle_digest([a, b]),
        "held": bundle_digest([a]),
        "stranger": bundle_digest([_root()]),  # a bundle the CA knows nothing of
        "empty": "",
    }
    for n, (pod, digest) in enumerate(bundles.items()):
        reports.record_report(_caller(pod, f"u{n}"), pod, digest, [], NOW)
    reports.record_csr(_caller(None, account="istio"), {}, "cc" * 20, sole_leaf=True, now=NOW)
    result = authority_coverage([("A", a), ("B", b)], _fleet(reports))
    assert result.trusting == {"A": 2, "B": 1}
    assert (result.reporting, result.unknown) == (4, 1)


def test_the_directory_sink_publishes_reports_beside_the_ledger(tmp_path: Path) -> None:
    mine, gone = LeafLedger(), LeafLedger()
    my_agents, gone_agents = AgentReports(), AgentReports()
    my_agents.record_report(_caller("p1", "u1"), "a", DIGEST, [], NOW)
    gone_agents.expire_after = timedelta(seconds=1)
    gone_agents.record_report(_caller("p2", "u2"), "b", DIGEST, [], NOW)
    DirectoryLedgerSink(tmp_path, "gone").save(gone, gone_agents, NOW)
    sink = DirectoryLedgerSink(tmp_path, "mine")
    sink.save(mine, my_agents, NOW)
    assert {e.pod for e in sink.agents(NOW).entries.values()} == {"default/p1", "default/p2"}
    assert not my_agents.changed
    later = NOW + timedelta(minutes=1)
    my_agents.record_report(_caller("p3", "u3"), "c", DIGEST, [], later)
    sink.save(mine, my_agents, later)  # sweeps the gone process's spent report
    assert sorted(p.name for p in (tmp_path / "agents").iterdir()) == ["mine.json"]
    assert {e.pod for e in sink.agents(later).entries.values()} == {"default/p1", "default/p3"}


def test_a_size_limited_snapshot_keeps_the_most_recent_and_counts_the_rest_as_unseen() -> None:
    reports = AgentReports()
    for n in range(100):
        at = NOW + timedelta(seconds=n)
        reports.record_report(_caller(f"pod-{n:03}", f"u{n}"), "a", DIGEST, [], at)
    text = reports.snapshot_json(NOW, max_bytes=8192)
    assert len(text) <= 8192 + 200
    fleet = merge_snapshots([("own", text)], NOW)
    assert 0 < len(fleet.entries) < 100 and fleet.dropped == 100 - len(fleet.entries)
    pods = {e.pod for e in fleet.entries.values()}
    assert "default/pod-099" in pods and "default/pod-000" not in pods
    counted = authority_coverage([("A", _root())], fleet)
    assert counted.unseen == fleet.dropped
    assert merge_snapshots([("own", reports.snapshot_json(NOW))], NOW).dropped == 0


def test_evicted_entries_count_as_unseen_until_they_would_have_expired() -> None:
    reports = AgentReports(capacity=3)
    for n in range(5):
        reports.record_report(_caller(f"p{n}", f"u{n}"), "a", DIGEST, [], NOW)
    fleet = _fleet(reports)
    assert (len(fleet.entries), fleet.dropped) == (3, 2)
    later = NOW + EXPIRE_AFTER
    reports.prune(later)
    assert _fleet(reports, later).dropped == 0


def test_serving_follows_the_leaves_each_agent_serves_never_undercounting() -> None:
    """`agents_serving`: what `revoke` would break. A pod agent's answered CSR moves it from the
    renewed leaf's authority to the signing one; a node agent (impersonating) keeps both until
    its next periodic report, since its other identities may still hold the old one."""
    old, new = "aa" * 20, "bb" * 20
    roots = [(old, _root()), (new, _root())]
    reports = AgentReports()
    pod, node = _caller("pod", "u1"), _caller("node", "u2", account="ztunnel")
    reports.record_report(pod, "pod-agent", DIGEST, [old], NOW)
    reports.record_report(node, "node-agent", DIGEST, [old], NOW)

    def serving() -> dict[str, int]:
        return authority_coverage(roots, _fleet(reports)).serving

    assert serving() == {old: 2, new: 0}
    renewing = {LEAF_AUTHORITY_HEADER: old}
    reports.record_csr(pod, {**_headers("pod-agent"), **renewing}, new, sole_leaf=True, now=NOW)
    reports.record_csr(node, {**_headers("node-agent"), **renewing}, new, sole_leaf=False, now=NOW)
    assert serving() == {old: 1, new: 2}
    reports.record_report(node, "node-agent", DIGEST, [new], NOW)
    assert serving() == {old: 0, new: 2}
    # A first CSR (no leaf yet) from a pod never seen, and a caller with no report headers.
    reports.record_csr(_caller("fresh", "u3"), _headers("fresh"), new, sole_leaf=True, now=NOW)
    reports.record_csr(_caller("istio", "u4"), {}, old, sole_leaf=True, now=NOW)
    assert serving() == {old: 0, new: 3}


def test_a_merge_with_nothing_changed_reuses_the_last_one_until_something_expires() -> None:
    """What keeps a rotator round cheap at 100,000 agents: the same snapshots (by digest) give
    the same merge, until the soonest expiry in it; a changed snapshot is merged again."""
    reports = AgentReports()
    reports.record_report(_caller("p1", "u1"), "a", DIGEST, [], NOW)
    reports.record_report(_caller("p2", "u2"), "b", DIGEST, [], NOW + timedelta(minutes=1))
    text = reports.snapshot_json(NOW + timedelta(minutes=1))
    cache = SnapshotCache()
    first = merge_snapshots([("own", text)], NOW + timedelta(minutes=1), cache=cache)
    again = merge_snapshots([("own", text)], NOW + timedelta(minutes=2), cache=cache)
    assert again is first
    # p1's entry expires before the snapshot turns stale: the merge is redone then.
    assert STALE_AFTER < EXPIRE_AFTER
    reports.record_report(_caller("p3", "u3"), "c", DIGEST, [], NOW + timedelta(minutes=2))
    changed = reports.snapshot_json(NOW + timedelta(minutes=2))
    third = merge_snapshots([("own", changed)], NOW + timedelta(minutes=2), cache=cache)
    assert third is not first and len(third.entries) == 3
    later = NOW + EXPIRE_AFTER + timedelta(seconds=1)
    republished = reports.snapshot_json(later)
    assert len(merge_snapshots([("own", republished)], later, cache=cache).entries) == 2
    stale = merge_snapshots(
        [("own", changed)], NOW + timedelta(minutes=2) + STALE_AFTER, cache=cache
    )
    assert stale.entries == {} and stale.stale == 1
