"""Issue #9 Done means 5: `meshca ca --activate-at-coverage 0.9` and ten real agent processes, of
which three are held back from the new root file. At the 5/6 point `meshca authority show` says
the activation waits at 7/10, and the CA does not activate; once the three see the new root it
activates within a poll. An Istio-style caller (a CSR without report headers) is counted as
unknown, never as reporting or covering.

Timing without waiting minutes: the test writes the CA's first authority itself, issued 560 s
in the past with a 720 s life (the same `LocalAuthorityStateStore` the CA uses, as after a
restart), and `--root-prepare-cap 140s`, so the CA prepares ~20 s after start and activation is
due ~40 s after start. The leaf TTL cap is then 120 s, so no agent renews (which would bring it
the new bundle in the CA's answer) before the test releases the held-back ones.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ca_server.authority.state_store import LocalAuthorityStateStore, SlotFactory
from certs import KeySpec, SpiffeId, build_csr, generate_private_key, load_certs
from meshca.clock import FakeClock
from tests.support.agent_process import AgentProcess
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.processes import wait_for

pytestmark = pytest.mark.process  # runs CA processes

AGENTS = 10
HELD_BACK = 3
LIFE = timedelta(seconds=720)  # activation lead (and leaf TTL cap): 120 s
AGE = timedelta(seconds=560)  # prepared at 580 s of its life, due at 600 s


def _show(ca: CaProcess) -> dict[str, Any]:
    result = meshca_authority(data_dir_target(ca.data_dir), "show", "-o", "json")
    assert result.returncode == 0, result.stderr
    shown: dict[str, Any] = json.loads(result.stdout)
    return shown


def _publish(path: Path, data: bytes) -> None:
    """Replaces `path` at once (rename), as a kubelet swaps a ConfigMap mount."""
    temporary = path.with_suffix(".new")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _by_state(shown: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["state"]: row for row in shown["authorities"]}


def test_gated_activation_waits_for_the_held_back_agents(short_dir: Path) -> None:
    data_dir = short_dir / "data"
    data_dir.mkdir()
    past = FakeClock(datetime.now(UTC) - AGE)
    LocalAuthorityStateStore(data_dir, SlotFactory(KeySpec(), "cluster.local", LIFE), past).read()
    ca = CaProcess(
        data_dir,
        "--root-ttl", "720s",
        "--root-prepare-cap", "140s",
        "--root-activate-cap", "130s",
        "--activate-at-coverage", "0.9",
        "--activate-deadline", "0.5",
        "--ca-reload-interval", "300ms",
    )  # fmt: skip
    ca.start()
    agents: list[AgentProcess] = []
    try:
        first_bundle = ca.root_cert_path.read_bytes()
        assert len(load_certs(first_bundle)) == 1
        for n in range(AGENTS):
            root_file = short_dir / f"root-{n}.pem"  # what this agent's kubelet mount shows
            root_file.write_bytes(first_bundle)
            agents.append(
                AgentProcess(
                    short_dir,
                    ca,
                    f"sa{n}",
                    secret_ttl="120s",
                    extra_args=("--ca-root", str(root_file), "--report-interval", "1s"),
                )
            )
        for agent in agents:
            agent.launch()
        for agent in agents:
            agent.wait_ready(60)
        wait_for(lambda: _show(ca)["authorities"][0]["agents_reporting"] == AGENTS, 30, "reports")

        # An Istio-style caller: a CSR without any report header.
        token = ca.mint_token("default", "istio-style")
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            identity = SpiffeId("cluster.local", "default", "istio-style")
            create_certificate(stub, build_csr(generate_private_key(), identity), token=token)

        wait_for(lambda: "prepared" in _by_state(_show(ca)), 40, "the CA to prepare")
        new_bundle = ca.root_cert_path.read_bytes()
        assert len(load_certs(new_bundle)) == 2
        for n in range(HELD_BACK, AGENTS):  # 7 kubelets refresh the mount; 3 do not (yet)
            _publish(short_dir / f"root-{n}.pem", new_bundle)

        def waiting_at_7_of_10() -> bool:
            gate = _show(ca)["activation_gate"]
            return gate is not None and (gate["agents_trusting"], gate["agents_reporting"]) == (
                AGENTS - HELD_BACK,
                AGENTS,
            )

        wait_for(waiting_at_7_of_10, 60, "the gate to wait at 7/10")
        shown = _show(ca)
        states = _by_state(shown)
        assert set(states) == {"active", "prepared"}  # not activated
        assert (states["prepared"]["agents_trusting"], states["prepared"]["agents_reporting"]) == (
            7,
            10,
        )
        assert (states["active"]["agents_trusting"], states["active"]["agents_reporting"]) == (
            10,
            10,
        )
        assert shown["agents_unknown"] == 1  # the Istio-style caller: unknown, not covered
        assert "activates anyway at" in shown["activation_gate"]["reason"]
        table = meshca_authority(data_dir_target(ca.data_dir), "show")
        assert "is WAITING (--activate-at-coverage): 7/10" in table.stdout, table.stdout
        assert '"msg": "authority-activation-gated"' in ca.log()
        prepared_id = states["prepared"]["id"]

        def gauges() -> tuple[float, float, float]:
            metrics = ca.metrics()
            return (
                sample_value(metrics, "meshca_ca_activation_gate_waiting"),
                sample_value(metrics, "meshca_ca_agents_reporting"),
                sample_value(
                    metrics, "meshca_ca_authority_agents_trusting", {"authority": prepared_id}
                ),
            )

        wait_for(lambda: gauges() == (1, 10, 7), 10, "the gate and coverage gauges")

        for n in range(HELD_BACK):  # released
            _publish(short_dir / f"root-{n}.pem", new_bundle)
        wait_for(
            lambda: _by_state(_show(ca)).get("active", {}).get("id") == prepared_id,
            20,
            "the gated activation once 9 or 10 of 10 trust it",
        )
        shown = _show(ca)
        assert shown["activation_gate"] is None
        activated = [
            json.loads(line)
            for line in ca.log().splitlines()
            if line.startswith("{") and '"authority-activated"' in line
        ]
        # At 9/10 already (90 %): whichever released agent reported second tipped it.
        reasons = [e["reason"] for e in activated]
        assert any(re.search(r"\b(9|10)/10 reporting agents trust it", r) for r in reasons), reasons
        assert "gate deadline" not in ca.log()  # activated by coverage, not by the deadline
    finally:
        for agent in agents:
            agent.stop()
        ca.stop()
