"""`meshca authority` on a data directory, as an operator runs it: what `show` prints, the
forced-rotation sequence, and the refusals that keep trust (nothing written when refused)."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ca_server.authority.slots import authority_id
from ca_server.authority.state_store import STATE_FILE, LocalAuthorityStateStore, SlotFactory
from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.leaf_ledger import DirectoryLedgerSink, LeafLedger
from certs import KeySpec, load_cert
from meshca.clock import SystemClock
from tests.support.agent_reports import pod_caller
from tests.support.authority_cli import authority_rows, data_dir_target, meshca_authority

pytestmark = pytest.mark.process  # every test runs `meshca authority`

FIELDS = {
    "id",
    "state",
    "tainted",
    "not_before",
    "not_after",
    "issuer",
    "live_leaves",
    "agents_trusting",
    "agents_reporting",
    "agents_serving",
    "agents_unseen",
}


def run(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return meshca_authority(data_dir_target(data_dir), *args)


def rows(data_dir: Path) -> list[dict[str, Any]]:
    return authority_rows(data_dir_target(data_dir))


def _ca_state(data_dir: Path) -> str:
    """What a first `meshca ca` start leaves behind: one active authority."""
    factory = SlotFactory(KeySpec(), "cluster.local", timedelta(days=30))
    state = LocalAuthorityStateStore(data_dir, factory, SystemClock()).read()
    return state.active.id


def test_show_without_a_ca_says_what_to_do(tmp_path: Path):
    result = run(tmp_path, "show")
    assert result.returncode == 2
    assert "start `meshca ca` with the same --data-dir" in result.stderr
    assert not (tmp_path / STATE_FILE).exists(), "show never creates a CA"


def test_show_prints_every_field_and_the_live_leaves_of_every_process(tmp_path: Path):
    active = _ca_state(tmp_path)
    now = datetime.now(UTC)
    for instance, count in (("ca-1", 3), ("ca-2", 2)):
        ledger = LeafLedger()
        agents = AgentReports()
        for _ in range(count):
            ledger.record(active, now + timedelta(hours=1), now)
        ledger.record(active, now - timedelta(minutes=5), now)  # expired: not counted
        DirectoryLedgerSink(tmp_path, instance).save(ledger, agents, now)
    (row,) = rows(tmp_path)
    assert set(row) == FIELDS
    assert row["id"] == active and row["state"] == "active" and row["tainted"] is False
    assert row["live_leaves"] == 5
    assert row["agents_trusting"] == row["agents_reporting"] == 0  # nobody reported
    assert row["issuer"] == "CN=meshca root,O=cluster.local"
    table = run(tmp_path, "show").stdout
    assert "LIVE LEAVES" in table and active in table and "active" in table


def test_forced_rotation_prepare_activate_taint_revoke(tmp_path: Path):
    first = _ca_state(tmp_path)
    refused = run(tmp_path, "activate")
    assert refused.returncode == 3
    assert (
        "no prepared authority" in refused.stderr and "meshca authority prepare" in refused.stderr
    )

    assert run(tmp_path, "prepare", "--root-ttl", "10d").returncode == 0
    prepared = next(r for r in rows(tmp_path) if r["state"] == "prepared")
    life = datetime.fromisoformat(prepared["not_after"]) - datetime.now(UTC)
    assert timedelta(days=9) < life <= timedelta(days=10)

    before = (tmp_path / STATE_FILE).read_bytes()
    refused = run(tmp_path, "taint", first)
    assert refused.returncode == 3 and "is active" in refused.stderr
    refused = run(tmp_path, "revoke", first)
    assert refused.returncode == 3 and "only allowed after `meshca authority taint`" in (
        refused.stderr
    )
    assert (tmp_path / STATE_FILE).read_bytes() == before, "a refusal writes nothing"

    activated = run(tmp_path, "activate", prepared["id"])
    assert activated.returncode == 0, activated.stderr
    audit = [json.loads(line) for line in activated.stderr.splitlines() if line.startswith("{")]
    assert {(a["msg"], a["authority"]) for a in audit} == {
        ("authority-activated", prepared["id"]),
        ("authority-retired", first),
    }
    assert {r["id"]: r["state"] for r in rows(tmp_path)} == {
        prepared["id"]: "active",
        first: "old",
    }
    active_cert = load_cert((tmp_path / "ca-cert.pem").read_bytes())
    assert authority_id(active_cert) == prepared["id"], "ca-cert.pem follows the active one"

    assert run(tmp_path, "taint", first[:10]).returncode == 0
    assert next(r for r in rows(tmp_path) if r["id"] == first)["tainted"] is True

    # An agent reports it still serves a leaf of the tainted one: revoke would break it.
    def agent_serving(authority: str) -> None:
        ledger = LeafLedger()
        agents = AgentReports()
        agents.record_report(
            pod_caller("pod-1"), "agent", "ab" * 32, [authority], datetime.now(UTC)
        )
        DirectoryLedgerSink(tmp_path, "ca-1").save(ledger, agents, datetime.now(UTC))

    agent_serving(first)
    before = (tmp_path / STATE_FILE).read_bytes()
    refused = run(tmp_path, "revoke", first)
    assert refused.returncode == 3, refused.stderr
    assert "1 reporting agent(s) still serve a leaf" in refused.stderr
    assert "--force" in refused.stderr
    assert (tmp_path / STATE_FILE).read_bytes() == before, "a refusal writes nothing"
    agent_serving(prepared["id"])  # it re-signed
    revoked = run(tmp_path, "revoke", first)
    assert revoked.returncode == 0, revoked.stderr
    assert [r["id"] for r in rows(tmp_path)] == [prepared["id"]]
    assert "authority-revoked" in revoked.stderr


def test_revoke_force_overrides_agents_still_serving(tmp_path: Path):
    first = _ca_state(tmp_path)
    assert run(tmp_path, "prepare").returncode == 0
    prepared = next(r["id"] for r in rows(tmp_path) if r["state"] == "prepared")
    assert run(tmp_path, "activate", prepared).returncode == 0
    assert run(tmp_path, "taint", first).returncode == 0
    ledger = LeafLedger()
    agents = AgentReports()
    agents.record_report(pod_caller("pod-1"), "agent", "ab" * 32, [first], datetime.now(UTC))
    DirectoryLedgerSink(tmp_path, "ca-1").save(ledger, agents, datetime.now(UTC))
    assert run(tmp_path, "revoke", first).returncode == 3
    forced = run(tmp_path, "revoke", first, "--force")
    assert forced.returncode == 0, forced.stderr
    assert [r["id"] for r in rows(tmp_path)] == [prepared]


def test_show_agents_lists_the_pods_behind_the_figures(tmp_path: Path):
    """`show ID --agents`: the pods not trusting ID and those serving its leaves, from every
    process's reports; an unreadable report is said, not hidden; without an ID, one line
    saying what to type."""
    active = _ca_state(tmp_path)
    now = datetime.now(UTC)
    ledger = LeafLedger()
    agents = AgentReports()
    agents.record_report(pod_caller("web-0"), "agent-a", "ab" * 32, [active], now)
    DirectoryLedgerSink(tmp_path, "ca-1").save(ledger, agents, now)
    shown = json.loads(run(tmp_path, "show", active[:10], "--agents", "-o", "json").stdout)
    (slot,) = shown["agents"]["authorities"]
    assert slot["id"] == active
    assert [p["pod"] for p in slot["not_trusting"]["pods"]] == ["default/web-0"]  # a stranger
    assert [p["agent_id"] for p in slot["serving"]["pods"]] == ["agent-a"]
    (tmp_path / "agents" / "ca-2.json").write_text("{broken")
    text = run(tmp_path, "show", active, "--agents")
    assert text.returncode == 0, text.stderr
    assert "1 pod(s) do not trust" in text.stdout and "default/web-0" in text.stdout
    assert "1 replica report(s) unreadable" in text.stdout
    assert "cannot be read" in text.stderr
    missing = run(tmp_path, "show", "--agents")
    assert missing.returncode == 3 and "show ID --agents" in missing.stderr
    assert "Traceback" not in missing.stderr
