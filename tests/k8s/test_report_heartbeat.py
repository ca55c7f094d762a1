"""Issue #17 scale, liveness apart from content (`ca_server.fleet.report_shards`): the real
`ConfigMapLedgerSink` publishing to the test API server and real readers merging. An idle
replica writes one object per report period and stays counted however old its shards are;
a replica whose heartbeat is stale stops counting; a shard is never counted from a text older
than the one its heartbeat vouches for, nor without a heartbeat; an agent that moved away and
back is counted for what it says now; an idle merge parses nothing."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta

import pytest

from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.entries import REPUBLISH_EVERY, STALE_AFTER
from ca_server.fleet.leaf_ledger import LeafLedger
from ca_server.fleet.report_shards import build_layout
from ca_server.kube import replica_reports
from ca_server.kube.replica_reports import ConfigMapLedgerSink, report_name
from tests.support.agent_reports import pod_caller
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE

OLD, NEW = "ab" * 32, "cd" * 32
PODS = 600
POLL = timedelta(seconds=15)


@pytest.fixture(autouse=True)
def _small_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_reports, "AGENTS_SHARD_BYTES", 16 * 1024)  # ~8 shards


def _writes(kube_api: KubeApiServer) -> int:
    return kube_api.count("create", "configmaps") + kube_api.count("update", "configmaps")


def _sink(kube_api: KubeApiServer, instance: str) -> ConfigMapLedgerSink:
    return ConfigMapLedgerSink(kube_api.api_client(), CA_NAMESPACE, instance)


def _report_all(agents: AgentReports, now: datetime, bundle: str = OLD) -> None:
    for n in range(PODS):
        agents.record_report(pod_caller(f"web-{n}"), "a", bundle, [], now)


def _shards(kube_api: KubeApiServer) -> list[str]:
    return sorted(
        cm["metadata"]["name"]
        for cm in kube_api.list("configmaps", namespace=CA_NAMESPACE)
        if replica_reports.SHARD_INFIX in cm["metadata"]["name"]
    )


def test_an_idle_replica_writes_once_per_period_and_its_old_shards_keep_counting(
    kube_api: KubeApiServer,
) -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    ledger, sink, reader = LeafLedger(), _sink(kube_api, "ca-0"), _sink(kube_api, "reader")
    agents = AgentReports()
    _report_all(agents, now)
    sink.save(ledger, agents, now)
    assert len(_shards(kube_api)) >= 3
    assert len(reader.agents(now).entries) == PODS
    before, started = _writes(kube_api), now
    # 30 minutes of polls, every agent re-reporting the same thing every 2 minutes: more than
    # twice STALE_AFTER, so the shards written at the start are older than a snapshot may be.
    while now < started + timedelta(minutes=30):
        now += POLL
        if (now - started) % REPUBLISH_EVERY == timedelta(0):
            _report_all(agents, now)
        sink.save(ledger, agents, now)
        fleet = reader.agents(now)
        assert (len(fleet.entries), fleet.unreadable, fleet.stale) == (PODS, 0, 0)
        assert reader._merger.reparsed == 0, "an idle round parsed a shard"
    assert now - started > 2 * STALE_AFTER
    periods = (now - started) / REPUBLISH_EVERY
    assert _writes(kube_api) - before == periods, "one write (the heartbeat) per period"

    # One pod changes: its shard and nothing else is written and parsed.
    agents.record_report(pod_caller("web-7"), "a", NEW, [], now)
    sink.save(ledger, agents, now)
    fleet = reader.agents(now)
    assert fleet.entries["/default/web-7/uid-web-7"].bundle == NEW
    assert reader._merger.reparsed == 1
    assert _writes(kube_api) - before == periods + 1


def test_a_replica_whose_heartbeat_is_stale_stops_counting(kube_api: KubeApiServer) -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    ledger, reader = LeafLedger(), _sink(kube_api, "reader")
    agents = AgentReports()
    _report_all(agents, now)
    _sink(kube_api, "ca-0").save(ledger, agents, now)  # then the process is gone
    fleet = reader.agents(now + STALE_AFTER - timedelta(seconds=1))
    assert (len(fleet.entries), fleet.stale) == (PODS, 0)
    fleet = reader.agents(now + STALE_AFTER)
    assert (len(fleet.entries), fleet.unreadable) == (0, 0) and fleet.stale == 1

    # Another replica sweeps the gone one's report and every shard of it.
    later = now + STALE_AFTER + timedelta(hours=2)  # its leaves (none) and heartbeat spent
    other, other_agents = LeafLedger(), AgentReports()
    other_agents.record_report(pod_caller("api-0"), "a", OLD, [], later)
    _sink(kube_api, "ca-1").save(other, other_agents, later)
    names = {cm["metadata"]["name"] for cm in kube_api.list("configmaps", namespace=CA_NAMESPACE)}
    assert names == {report_name("ca-1")}


def test_a_shard_is_never_counted_from_a_text_older_than_its_heartbeat_vouches_for(
    kube_api: KubeApiServer,
) -> None:
    """A write that did not land, or a reader that sees an older version: the shard is
    unreadable (not trusting, maybe serving), never counted for what its old text said."""
    now = datetime(2026, 12, 1, tzinfo=UTC)
    ledger, sink, reader = LeafLedger(), _sink(kube_api, "ca-0"), _sink(kube_api, "reader")
    agents = AgentReports()
    _report_all(agents, now, NEW)
    sink.save(ledger, agents, now)
    name = _shards(kube_api)[0]
    old = copy.deepcopy(kube_api.get("configmaps", name, namespace=CA_NAMESPACE))
    pods = set(replica_reports.parse_shard(old["data"][replica_reports.AGENTS]).entries)
    # Those pods stop trusting NEW; the shard is rewritten and a heartbeat lists it.
    later = now + REPUBLISH_EVERY
    for key in pods:
        pod = key.split("/")[2]
        agents.record_report(pod_caller(pod), "a", OLD, [], later)
    sink.save(ledger, agents, later)
    fleet = reader.agents(later)
    assert {fleet.entries[key].bundle for key in pods} == {OLD} and fleet.unreadable == 0

    current = kube_api.get("configmaps", name, namespace=CA_NAMESPACE)
    old["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    kube_api.update("configmaps", old)  # what the heartbeat no longer vouches for
    fleet = reader.agents(later)
    assert fleet.unreadable == 1
    assert not pods & fleet.entries.keys(), "an old text counted as trusting NEW"
    assert sum(e.bundle == NEW for e in fleet.entries.values()) == PODS - len(pods)

    kube_api.delete("configmaps", name, namespace=CA_NAMESPACE)  # gone altogether
    fleet = reader.agents(later)
    assert fleet.unreadable == 1 and not pods & fleet.entries.keys()
    # The writer notices its missing shard (its sweep) and writes it again.
    heal = later + REPUBLISH_EVERY
    sink.save(ledger, agents, heal)
    sink.save(ledger, agents, heal + POLL)
    fleet = reader.agents(heal + POLL)
    assert fleet.unreadable == 0 and {fleet.entries[key].bundle for key in pods} == {OLD}


def test_shards_without_a_heartbeat_are_unreadable_then_stale(kube_api: KubeApiServer) -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    ledger, reader = LeafLedger(), _sink(kube_api, "reader")
    agents = AgentReports()
    _report_all(agents, now, NEW)
    _sink(kube_api, "ca-0").save(ledger, agents, now)
    shards = len(_shards(kube_api))
    kube_api.delete("configmaps", report_name("ca-0"), namespace=CA_NAMESPACE)
    fleet = reader.agents(now)
    assert fleet.unreadable == shards and len(fleet.entries) == 0
    fleet = reader.agents(now + STALE_AFTER)
    assert (fleet.unreadable, fleet.stale) == (0, shards)


def test_an_agent_that_moved_away_and_back_is_counted_for_what_it_says_now(
    kube_api: KubeApiServer,
) -> None:
    """`web-0` says OLD on R1, moves to R2 and says NEW there, then moves back to R1 and says
    OLD again — what R1's older entry already held, so that entry's `since` is older than
    R2's copy. Reclaimed from R1's own merge (which shows R2's copy winning), every reader
    counts OLD by the agent's next report, and it stays so."""
    now = datetime(2026, 12, 1, tzinfo=UTC)
    one, two = AgentReports(), AgentReports()
    sinks = [(one, _sink(kube_api, "ca-1")), (two, _sink(kube_api, "ca-2"))]
    reader = _sink(kube_api, "reader")
    caller = pod_caller("web-0")
    key = "/default/web-0/uid-web-0"

    def period(on: AgentReports, bundle: str) -> str | None:
        """The agent reports once; every replica publishes and merges (its rotator's round)."""
        nonlocal now
        now += REPUBLISH_EVERY
        on.record_report(caller, "a", bundle, [], now)
        for _ in range(2):
            for agents, sink in sinks:
                sink.save(LeafLedger(), agents, now)
                sink.agents(now)
            now += POLL
        return reader.agents(now).entries[key].bundle

    assert period(one, OLD) == OLD
    assert period(two, NEW) == NEW
    period(one, OLD)  # R1's copy is older than R2's: R2's NEW still wins this once
    assert period(one, OLD) == OLD
    assert period(one, OLD) == OLD, "stable: R2's older copy does not win back"


def test_the_shard_count_holds_while_the_fleet_changes_a_little() -> None:
    """A resize rewrites every shard: a fleet growing by a few pods keeps its count (while
    every shard still fits with room to spare); doubling it resizes, nothing dropped."""
    now = datetime(2026, 12, 1, tzinfo=UTC)
    agents = AgentReports()
    _report_all(agents, now)
    budget = 16 * 1024
    count = len(build_layout(agents.shard_view(now), budget).shards)
    assert count >= 3
    for n in range(PODS, PODS + 20):
        agents.record_report(pod_caller(f"web-{n}"), "a", OLD, [], now)
    grown = agents.shard_view(now)
    kept = build_layout(grown, budget, 64, count)
    assert len(kept.shards) == count and kept.dropped == 0
    assert len(build_layout(grown, budget, 64, count + 1).shards) == count + 1
    for n in range(PODS + 20, 2 * PODS):
        agents.record_report(pod_caller(f"web-{n}"), "a", OLD, [], now)
    doubled = build_layout(agents.shard_view(now), budget, 64, count)
    assert len(doubled.shards) > count and doubled.dropped == 0
    assert sum(len(shard.agents) for shard in doubled.shards) == 2 * PODS
