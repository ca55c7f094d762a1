"""Issue #17 Done means 1: coverage no workload token can forge. A real `meshca ca`, real
development tokens (each bound to a pod, as `meshca token` mints them), real RPCs: legitimate
agents report what they hold, attacker tokens try to inflate, deflate, block a revoke and zero
someone else's SERVING. With one token no figure (`trusting`, `reporting`, `SERVING`, the gate's
decision, `revoke`'s refusal) moves by more than one agent, and `--agents` names the pod.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.trust_bundle import bundle_digest
from ca_server.authority.slots import authority_id
from ca_server.authority.state_store import LocalAuthorityStateStore, SlotFactory
from certs import KeySpec, SpiffeId, build_csr, generate_private_key, load_certs
from meshca.clock import FakeClock
from meshca_proto import report_pb2
from tests.support.agent_reports import report_headers, reporting_csr
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_client import ca_stub, create_certificate, report_channel, send_report
from tests.support.ca_process import CaProcess
from tests.support.processes import wait_for

pytestmark = pytest.mark.process  # every test runs a CA

FORGED = 100


def _show(ca: CaProcess, *args: str) -> dict[str, Any]:
    result = meshca_authority(data_dir_target(ca.data_dir), "show", *args, "-o", "json")
    assert result.returncode == 0, result.stderr
    shown: dict[str, Any] = json.loads(result.stdout)
    return shown


def _figures(ca: CaProcess) -> dict[str, int]:
    """Every coverage figure `show` prints, flattened: per authority trusting and serving, and
    the reporting/unknown counts."""
    shown = _show(ca)
    figures = {"reporting": shown["authorities"][0]["agents_reporting"]}
    figures["unknown"] = shown["agents_unknown"]
    for row in shown["authorities"]:
        figures[f"trusting:{row['id']}"] = row["agents_trusting"]
        figures[f"serving:{row['id']}"] = row["agents_serving"]
    return figures


def _moved_at_most_one(before: dict[str, int], after: dict[str, int]) -> None:
    moved = {k: after[k] - before[k] for k in before if abs(after[k] - before[k]) > 1}
    assert not moved, f"one token moved figures by more than one agent: {moved}"


def _report(
    channel: Any, token: str, agent_id: str, digest: str, leaves: Sequence[str] = ()
) -> None:
    request = report_pb2.AgentReportRequest(
        agent_id=agent_id, trust_bundle_sha256=digest, leaf_authorities=list(leaves)
    )
    send_report(channel, request, token=token)


def _authority(ca: CaProcess, *args: str) -> None:
    result = meshca_authority(data_dir_target(ca.data_dir), *args)
    assert result.returncode == 0, result.stderr


def test_one_token_cannot_block_a_revoke_or_zero_another_pods_serving(tmp_path: Path) -> None:
    ca = CaProcess(tmp_path / "data", "--ca-reload-interval", "200ms")
    ca.start()
    try:
        _authority(ca, "prepare")
        _authority(ca, "activate")
        rows = {row["state"]: row["id"] for row in _show(ca)["authorities"]}
        new, old = rows["active"], rows["old"]
        _authority(ca, "taint", old)
        roots = {authority_id(r): r for r in load_certs(ca.root_cert_path.read_bytes())}
        both = bundle_digest(roots.values())
        legit = {
            f"legit-{n}": ca.mint_token("shop", "web", pod_name=f"legit-{n}") for n in range(3)
        }
        evil = {f"evil-{n}": ca.mint_token("evil", "evil", pod_name=f"evil-{n}") for n in range(3)}
        with report_channel(ca.addr, ca.root_cert_path.read_bytes()) as channel:
            for pod, token in legit.items():  # they re-signed: serving the new one only
                _report(channel, token, pod, both, [new])
            wait_for(lambda: _figures(ca)["reporting"] == 3, 10, "the legitimate reports")
            before = _figures(ca)
            assert before[f"serving:{old}"] == 0

            # Block a revoke: 100 made-up agents claiming a leaf of the tainted authority.
            for n in range(FORGED):
                _report(channel, evil["evil-0"], f"forged-{n}", both, [old, new])
            wait_for(lambda: _figures(ca)["reporting"] == 4, 10, "the attacker's one entry")
            after = _figures(ca)
            _moved_at_most_one(before, after)
            assert after[f"serving:{old}"] == 1

            # The refusal holds (one pod could really serve one), and names that pod.
            refused = meshca_authority(data_dir_target(ca.data_dir), "revoke", old)
            assert refused.returncode == 3 and "1 reporting agent(s)" in refused.stderr
            listing = _show(ca, old, "--agents")["agents"]
            (slot,) = listing["authorities"]
            assert slot["serving"]["count"] == 1
            (pod,) = slot["serving"]["pods"]
            assert pod["pod"] == "evil/evil-0"
            assert pod["identity"] == "spiffe://cluster.local/ns/evil/sa/evil"
            assert pod["agent_id"] == f"forged-{FORGED - 1}"  # a label, shown as such
            top = listing["top_callers"][0]
            assert (top["identity"], top["reports"]) == (pod["identity"], FORGED)
            assert top["relabels"] == FORGED - 1  # the outlier is plain to see
            text = meshca_authority(data_dir_target(ca.data_dir), "show", old, "--agents")
            assert "1 pod(s) still serve a leaf of" in text.stdout and "evil/evil-0" in text.stdout

            # Zero someone else's SERVING: a CSR naming a legitimate agent's id and a leaf of
            # the new authority it "renewed" changes only the attacker's own pod.
            before = _figures(ca)
            token = evil["evil-1"]
            for n in range(3):
                headers = report_headers(f"legit-{n}", both, new)
                reporting_csr(ca, headers, account="evil", namespace="evil", token=token)
            wait_for(lambda: _figures(ca)["reporting"] == 5, 10, "the second attacker's entry")
            after = _figures(ca)
            _moved_at_most_one(before, after)
            assert after[f"serving:{new}"] == before[f"serving:{new}"] + 1  # its own new leaf

            # A refused CSR (an identity the token does not hold) records nothing.
            before = _figures(ca)
            identity = SpiffeId("cluster.local", "shop", "web")
            roots_pem = ca.root_cert_path.read_bytes()
            with ca_stub(ca.addr, roots_pem) as stub, pytest.raises(grpc.RpcError):
                create_certificate(
                    stub,
                    build_csr(generate_private_key(), identity),
                    token=evil["evil-2"],
                    headers=report_headers("legit-0", "00" * 32, old),
                )

            def legit_0_reported() -> str:
                serving = _show(ca, new, "--agents")["agents"]["authorities"][0]["serving"]
                return next(p["last_report"] for p in serving["pods"] if p["pod"] == "shop/legit-0")

            seen = legit_0_reported()
            _report(channel, legit["legit-0"], "legit-0", both, [new])  # a later publication
            wait_for(lambda: legit_0_reported() != seen, 10, "a publication after the refusal")
            assert _figures(ca) == before
            assert "evil/evil-2" not in json.dumps(_show(ca, new, "--agents"))

        # The attacker's pod stops claiming the leaf (or the operator deals with it): revoke
        # goes through without --force.
        with report_channel(ca.addr, ca.root_cert_path.read_bytes()) as channel:
            _report(channel, evil["evil-0"], "evil", both, [new])
        wait_for(lambda: _figures(ca)[f"serving:{old}"] == 0, 10, "SERVING 0")
        _authority(ca, "revoke", old)
    finally:
        ca.stop()
    assert "Traceback" not in ca.log()


LIFE = timedelta(seconds=720)  # activation lead (and leaf TTL cap): 120 s
AGE = timedelta(seconds=560)  # prepared ~20 s after start, activation due ~40 s after start


def test_one_token_cannot_inflate_or_deflate_the_activation_gate(short_dir: Path) -> None:
    """The inflate attack of the issue: 100 forged agents trusting the new root. The gate
    stays at 1/(3 + attackers) and keeps waiting; a deflating token (a digest matching no
    root) adds one not-trusting agent, no more."""
    data_dir = short_dir / "data"
    data_dir.mkdir()
    past = FakeClock(datetime.now(UTC) - AGE)
    LocalAuthorityStateStore(data_dir, SlotFactory(KeySpec(), "cluster.local", LIFE), past).read()
    ca = CaProcess(
        data_dir,
        "--root-ttl", "720s",
        "--root-prepare-cap", "140s",
        "--root-activate-cap", "130s",
        "--activate-at-coverage", "0.95",
        "--activate-deadline", "0.9",
        "--ca-reload-interval", "300ms",
    )  # fmt: skip
    ca.start()
    try:
        (first,) = load_certs(ca.root_cert_path.read_bytes())
        old_only = bundle_digest([first])
        legit = {
            f"legit-{n}": ca.mint_token("shop", "web", pod_name=f"legit-{n}") for n in range(3)
        }
        inflater = ca.mint_token("evil", "evil", pod_name="evil-0")
        deflater = ca.mint_token("evil", "evil", pod_name="evil-1")
        with report_channel(ca.addr, ca.root_cert_path.read_bytes()) as channel:
            for pod, token in legit.items():
                _report(channel, token, pod, old_only)
            wait_for(lambda: len(load_certs(ca.root_cert_path.read_bytes())) == 2, 40, "prepare")
            both = bundle_digest(load_certs(ca.root_cert_path.read_bytes()))
            before = _figures(ca)
            for n in range(FORGED):
                _report(channel, inflater, f"forged-{n}", both)
            wait_for(lambda: _figures(ca)["reporting"] == 4, 10, "the inflater's one entry")
            _moved_at_most_one(before, _figures(ca))
            before = _figures(ca)
            for n in range(10):
                _report(channel, deflater, f"stranger-{n}", "00" * 32)
            wait_for(lambda: _figures(ca)["reporting"] == 5, 10, "the deflater's one entry")
            _moved_at_most_one(before, _figures(ca))

        def gate() -> dict[str, Any] | None:
            waiting: dict[str, Any] | None = _show(ca)["activation_gate"]
            return waiting

        wait_for(lambda: gate() is not None, 60, "the activation to come due and wait")
        waiting = gate()
        assert waiting is not None
        assert (waiting["agents_trusting"], waiting["agents_reporting"]) == (1, 5)
        states = {row["state"] for row in _show(ca)["authorities"]}
        assert states == {"active", "prepared"}, "100 forged agents did not activate it"
        prepared = next(r for r in _show(ca)["authorities"] if r["state"] == "prepared")
        listing = _show(ca, prepared["id"], "--agents")["agents"]["authorities"][0]
        assert listing["not_trusting"]["count"] == 4
        assert {p["pod"] for p in listing["not_trusting"]["pods"]} == {
            "shop/legit-0",
            "shop/legit-1",
            "shop/legit-2",
            "evil/evil-1",
        }
    finally:
        ca.stop()
    assert "Traceback" not in ca.log()
