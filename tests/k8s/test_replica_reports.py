"""The replica report ConfigMaps as a ledger sink (`ca_server.kube.replica_reports`): what a
rotator round reads, and what it costs the API server."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from ca_server.fleet import jwt_coverage
from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.entries import REPUBLISH_EVERY
from ca_server.fleet.leaf_ledger import LeafLedger
from ca_server.kube import replica_reports
from ca_server.kube.replica_reports import ConfigMapLedgerSink, report_name
from tests.support.agent_reports import pod_caller
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE


def test_a_round_reads_leaves_and_agents_with_one_list_call(kube_api: KubeApiServer) -> None:
    now = datetime.now(UTC)
    for replica, leaves in (("ca-0", 3), ("ca-1", 2)):
        ledger = LeafLedger()
        agents = AgentReports()
        for _ in range(leaves):
            ledger.record("aa" * 20, now + timedelta(hours=1), now)
        agents.record_report(pod_caller(f"agent-{replica}"), "agent", "ab" * 32, ["aa" * 20], now)
        ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, replica).save(ledger, agents, now)
    sink = ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, "reader")

    before = kube_api.count("list", "configmaps")
    live, fleet = sink.figures(now)
    assert kube_api.count("list", "configmaps") == before + 1
    assert live == sink.live(now) == {"aa" * 20: 5}
    assert fleet == sink.agents(now)
    assert {e.pod for e in fleet.entries.values()} == {"default/agent-ca-0", "default/agent-ca-1"}


def test_agent_reports_are_sharded_exactly_and_rewritten_only_when_they_change(
    kube_api: KubeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #17 scale: every object under its size limit (here 64 KiB, to need a few shards),
    every pod counted (nothing dropped), an unchanged shard never written again (liveness is
    the heartbeat's), one changed pod rewriting one shard, and shards no longer needed
    deleted."""
    monkeypatch.setattr(replica_reports, "AGENTS_SHARD_BYTES", 64 * 1024)
    now = datetime.now(UTC)
    ledger = LeafLedger()
    agents = AgentReports()
    for n in range(2000):
        agents.record_report(pod_caller(f"web-{n}"), "a", "ab" * 32, ["aa" * 20], now)
    sink = ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, "ca-0")
    sink.save(ledger, agents, now)
    objects = kube_api.list("configmaps", namespace=CA_NAMESPACE)
    sizes = [len(json.dumps(cm["data"])) for cm in objects]
    assert len(objects) >= 8 and max(sizes) < 64 * 1024 + 4096
    fleet = ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, "reader").agents(now)
    assert (len(fleet.entries), fleet.dropped, fleet.unreadable) == (2000, 0, 0)

    def writes() -> int:
        return kube_api.count("create", "configmaps") + kube_api.count("update", "configmaps")

    before = writes()
    later = now + timedelta(seconds=10)
    for n in range(2000):  # every pod refreshes, nothing a decision reads changes
        agents.record_report(pod_caller(f"web-{n}"), "a", "ab" * 32, ["aa" * 20], later)
    sink.save(ledger, agents, later)
    assert writes() == before
    agents.record_report(pod_caller("web-7"), "a", "cd" * 32, ["aa" * 20], later)
    sink.save(ledger, agents, later)
    assert writes() == before + 1
    sink.save(ledger, agents, later + REPUBLISH_EVERY)  # due: the heartbeat (the report object)
    assert writes() == before + 2

    small, few_agents = LeafLedger(), AgentReports()
    for n in range(100):
        few_agents.record_report(pod_caller(f"web-{n}"), "a", "ab" * 32, [], later)
    # A restart with a smaller fleet: fewer shards, the others deleted.
    sink = ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, "ca-0")
    sink.save(small, few_agents, later)
    assert [
        cm["metadata"]["name"] for cm in kube_api.list("configmaps", namespace=CA_NAMESPACE)
    ] == [report_name("ca-0")]
    assert len(sink.agents(later).entries) == 100


def test_the_jwt_kids_agents_hold_reach_every_replica_through_the_configmaps(
    kube_api: KubeApiServer,
) -> None:
    """The JWT key gate's figure in Kubernetes mode: each replica publishes the kids its agents
    reported in its shards, and any replica's merge counts them all (`jwt_coverage`)."""
    now = datetime.now(UTC)
    new, old = "N" * 43, "O" * 43
    held = {"ca-0": [new, old], "ca-1": [old]}
    for replica, kids in held.items():
        agents = AgentReports()
        agents.record_report(pod_caller(f"agent-{replica}"), "a", "ab" * 32, [], now, jwt_keys=kids)
        agents.record_report(pod_caller(f"idle-{replica}"), "a", "ab" * 32, [], now)
        sink = ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, replica)
        sink.save(LeafLedger(), agents, now)
    fleet = ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, "reader").agents(now)
    assert len(fleet.entries) == 4
    counted = jwt_coverage(new, fleet)
    assert (counted.trusting, counted.reporting) == (1, 2)  # the idle agents are not counted
    assert jwt_coverage(old, fleet).reaches(1.0)
