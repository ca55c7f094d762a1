"""Issue #9 "coverage": a real `meshca ca` counts which authorities the agents trust from the
report headers on their CSRs, and `meshca authority show -o json` prints it — Istio-style
callers (no headers) counted apart as unknown, never as covered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.trust_bundle import bundle_digest
from ca_server.authority.slots import authority_id
from certs import load_certs
from tests.support.agent_reports import report_headers, reporting_csr
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.processes import wait_for

pytestmark = pytest.mark.process  # runs a CA and agents


def _show(data_dir: Path) -> dict[str, Any]:
    result = meshca_authority(data_dir_target(data_dir), "show", "-o", "json")
    assert result.returncode == 0, result.stderr
    shown: dict[str, Any] = json.loads(result.stdout)
    return shown


def _fractions(shown: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {
        row["id"]: (row["agents_trusting"], row["agents_reporting"]) for row in shown["authorities"]
    }


def test_show_reports_which_authorities_the_agents_trust(tmp_path: Path) -> None:
    ca = CaProcess(tmp_path / "data", "--ca-reload-interval", "200ms")
    ca.start()
    try:
        assert meshca_authority(data_dir_target(ca.data_dir), "prepare").returncode == 0
        wait_for(lambda: len(load_certs(ca.root_cert_path.read_bytes())) == 2, 20, "bundle {A, B}")
        roots = load_certs(ca.root_cert_path.read_bytes())
        by_state = {row["state"]: row["id"] for row in _show(ca.data_dir)["authorities"]}
        a = next(r for r in roots if authority_id(r) == by_state["active"])
        b = next(r for r in roots if authority_id(r) == by_state["prepared"])
        both, old_only = bundle_digest([a, b]), bundle_digest([a])
        a_id = authority_id(a)
        for n in range(4):  # renewed, holding {A, B}
            reporting_csr(ca, report_headers(f"new-{n}", both, a_id))
        held = [reporting_csr(ca, report_headers(f"held-{n}", old_only)) for n in range(3)]
        # A malformed digest is ignored, not refused: reporting, trusting nothing.
        reporting_csr(ca, report_headers("garbled", "not-a-digest"))
        reporting_csr(ca, [], account="istio-style")  # Istio's agent: no report at all
        reporting_csr(ca, [], account="istio-style")  # twice: still one unknown caller

        expected = {a_id: (7, 8), authority_id(b): (4, 8)}
        wait_for(lambda: _fractions(_show(ca.data_dir)) == expected, 20, f"coverage {expected}")
        assert _show(ca.data_dir)["agents_unknown"] == 1
        # Every reporting agent now serves the leaf A just signed for it; none serves one of B.
        serving = {row["id"]: row["agents_serving"] for row in _show(ca.data_dir)["authorities"]}
        assert serving == {a_id: 8, authority_id(b): 0}

        def serving_gauges() -> list[float]:
            metrics = ca.metrics()
            name = "meshca_ca_authority_agents_serving"
            return [sample_value(metrics, name, {"authority": i}) for i in (a_id, authority_id(b))]

        wait_for(lambda: serving_gauges() == [8, 0], 10, "the agents_serving gauges")

        # One held-back agent sees the new root: the same pod counts once, with its latest
        # (even after an agent restart: a new agent id from the same pod).
        reporting_csr(ca, report_headers("held-0-restarted", both), token=held[0])
        expected = {a_id: (7, 8), authority_id(b): (5, 8)}
        wait_for(lambda: _fractions(_show(ca.data_dir)) == expected, 20, f"coverage {expected}")

        table = meshca_authority(data_dir_target(ca.data_dir), "show")
        assert table.returncode == 0, table.stderr
        assert "5/8" in table.stdout and "7/8" in table.stdout
        assert "counted as unknown): 1" in table.stdout
    finally:
        ca.stop()
