"""The JWT kids agents report (`ca_server.fleet`): bounded at the report edge, kept for the pod
the credential proves, published only for agents that hold a JWT bundle (everyone else's entry
is byte-for-byte what it was), read back by both readers (snapshots and shards), and counted by
the JWT key's coverage rule (`jwt_coverage`). Time is injected: nothing here sleeps."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from ca_server.authn import Caller
from ca_server.errors import InvalidRequestError
from ca_server.fleet import (
    MAX_REPORTED_JWT_KEYS,
    AgentReports,
    ProcessReports,
    ShardMerger,
    ShardObject,
    build_layout,
    generation_of,
    heartbeat_text,
    jwt_coverage,
    merge_snapshots,
)
from ca_server.report_service import check_report_size
from ca_server.wire import AGENT_ID_HEADER
from certs import SpiffeId
from meshca_proto import report_pb2

NOW = datetime(2026, 12, 1, 4, 0, tzinfo=UTC)
DIGEST = "ab" * 32
OLD_KID = "A" * 43
NEW_KID = "B" * 43


def _caller(pod: str) -> Caller:
    return Caller(
        SpiffeId("cluster.local", "default", "sleep"),
        "jwt",
        subject="system:serviceaccount:default:sleep",
        pod_name=pod,
        pod_uid=f"uid-{pod}",
    )


def _table() -> AgentReports:
    """web-0 holds both keys, web-1 only the old one, web-2 no JWT bundle at all."""
    reports = AgentReports()
    reports.record_report(_caller("web-0"), "a", DIGEST, [], NOW, jwt_keys=[NEW_KID, OLD_KID])
    reports.record_report(_caller("web-1"), "a", DIGEST, [], NOW, jwt_keys=[OLD_KID])
    reports.record_report(_caller("web-2"), "a", DIGEST, [], NOW)
    return reports


def test_snapshots_carry_the_kids_only_for_agents_that_hold_a_jwt_bundle():
    reports = _table()
    published = json.loads(reports.snapshot_json(NOW))["agents"]
    by_pod = {key.split("/")[2]: fields for key, fields in published.items()}
    assert len(by_pod["web-2"]) == 7  # exactly as before JWT kids existed
    assert set(by_pod["web-0"][7].split(",")) == {NEW_KID, OLD_KID}
    fleet = merge_snapshots([("own", reports.snapshot_json(NOW))], NOW)
    held = {entry.pod: entry.jwt_keys for entry in fleet.entries.values()}
    assert held == {
        "default/web-0": {NEW_KID, OLD_KID},
        "default/web-1": {OLD_KID},
        "default/web-2": frozenset(),
    }
    # The agent without a JWT bundle strands nothing: not counted either way.
    new = jwt_coverage(NEW_KID, fleet)
    assert (new.trusting, new.reporting) == (1, 2)
    assert not new.reaches(1.0) and new.reaches(0.5)
    assert new.said("hold") == "1/2 reporting agents hold it"
    assert jwt_coverage(OLD_KID, fleet).reaches(1.0)


def test_shards_carry_the_kids_and_read_them_back():
    reports = _table()
    layout = build_layout(reports.shard_view(NOW), 900 * 1024)
    (shard,) = layout.shards
    text = shard.text(NOW.timestamp())
    assert sorted(len(fields) for fields in json.loads(text)["agents"].values()) == [6, 7, 7]
    generation = generation_of(text)
    beat = heartbeat_text(layout, {0: generation}, NOW)
    process = ProcessReports("cm/r1", beat, {0: ShardObject("cm/r1-0", generation, text)})
    counted = jwt_coverage(NEW_KID, ShardMerger().merge([process], NOW))
    assert (counted.trusting, counted.reporting) == (1, 2)


def test_a_csr_keeps_the_kids_of_the_same_runs_report():
    reports = AgentReports()
    reports.record_report(_caller("web-0"), "run-1", DIGEST, [], NOW, jwt_keys=[NEW_KID])
    reports.record_csr(
        _caller("web-0"), {AGENT_ID_HEADER: "run-1"}, "aa" * 20, sole_leaf=True, now=NOW
    )
    fleet = merge_snapshots([("own", reports.snapshot_json(NOW))], NOW)
    assert jwt_coverage(NEW_KID, fleet).trusting == 1
    # A restarted agent (a new run) has said nothing of JWT keys yet.
    later = NOW + timedelta(seconds=1)
    reports.record_csr(
        _caller("web-0"), {AGENT_ID_HEADER: "run-2"}, "aa" * 20, sole_leaf=True, now=later
    )
    fleet = merge_snapshots([("own", reports.snapshot_json(later))], later)
    assert jwt_coverage(NEW_KID, fleet).reporting == 0


def test_malformed_kids_are_ignored_and_too_many_or_too_long_are_refused():
    reports = AgentReports()
    reports.record_report(
        _caller("web-0"), "a", DIGEST, [], NOW, jwt_keys=["not a kid!", "", NEW_KID]
    )
    fleet = merge_snapshots([("own", reports.snapshot_json(NOW))], NOW)
    (entry,) = fleet.entries.values()
    assert entry.jwt_keys == {NEW_KID}
    many = report_pb2.AgentReportRequest(
        agent_id="a", jwt_kids=[f"k{n}" for n in range(MAX_REPORTED_JWT_KEYS + 1)]
    )
    with pytest.raises(InvalidRequestError, match="jwt_kids holds 9 entries, at most 8"):
        check_report_size(many)
    long = report_pb2.AgentReportRequest(agent_id="a", jwt_kids=["k" * 65])
    with pytest.raises(InvalidRequestError, match="a jwt_kids entry holds 65 characters"):
        check_report_size(long)
    check_report_size(report_pb2.AgentReportRequest(agent_id="a", jwt_kids=[NEW_KID] * 8))


def test_a_reader_refuses_an_entry_of_another_length():
    """Neither 7 nor 8 fields: the snapshot is unreadable (counted as not holding), never
    guessed at."""
    text = json.dumps(
        {
            "format": 2,
            "published": NOW.timestamp(),
            "agents": {"/default/web-0/u": ["id", None, None, None, None, 1.0, 2e9, "k", "x"]},
        }
    )
    fleet = merge_snapshots([("odd", text)], NOW)
    assert fleet.unreadable == 1 and not jwt_coverage(NEW_KID, fleet).reaches(0.1)
