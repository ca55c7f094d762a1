"""The replica report ConfigMaps as a ledger sink (`ca_server.kube.replica_reports`): what a
rotator round reads, and what it costs the API server."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ca_server.kube.replica_reports import ConfigMapLedgerSink
from ca_server.leaf_ledger import LeafLedger
from tests.k8s.conftest import CA_NAMESPACE
from tests.support.agent_reports import pod_caller
from tests.support.kube_api import KubeApiServer


def test_a_round_reads_leaves_and_agents_with_one_list_call(kube_api: KubeApiServer) -> None:
    now = datetime.now(UTC)
    for replica, leaves in (("ca-0", 3), ("ca-1", 2)):
        ledger = LeafLedger()
        for _ in range(leaves):
            ledger.record("aa" * 20, now + timedelta(hours=1), now)
        ledger.agents.record_report(
            pod_caller(f"agent-{replica}"), "agent", "ab" * 32, ["aa" * 20], now
        )
        ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, replica).save(ledger, now)
    sink = ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, "reader")

    before = kube_api.count("list", "configmaps")
    live, fleet = sink.figures(now)
    assert kube_api.count("list", "configmaps") == before + 1
    assert live == sink.live(now) == {"aa" * 20: 5}
    assert fleet == sink.agents(now)
    assert {e.pod for e in fleet.entries.values()} == {"default/agent-ca-0", "default/agent-ca-1"}
