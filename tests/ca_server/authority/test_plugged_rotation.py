"""Done means (CA side of 2): a plugged-in root change A → A+B → signing under B → B alone,
through the cacerts directory of a running CA. A new intermediate under the same root is a hot
swap; a step that would strand workloads is refused with what to do, the current authority kept,
and the CA keeps serving; the refused step is taken once it becomes safe."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ca_server.authority.slots import authority_id
from certs import (
    SpiffeId,
    build_csr,
    generate_private_key,
    load_cert,
    load_certs,
    verify_chain,
)
from certs.bundle import bundle_digest
from meshca.wire import AGENT_ID_HEADER, TRUST_BUNDLE_HEADER
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.pki import TestCa
from tests.support.processes import wait_for

pytestmark = pytest.mark.process  # every test runs a CA

SLEEP = SpiffeId("cluster.local", "default", "sleep")
NOW = datetime.now(UTC)


def root() -> TestCa:
    return TestCa(NOW, lifetime=timedelta(days=30))


def intermediate(parent: TestCa) -> TestCa:
    return parent.child_ca(lifetime=timedelta(days=7))


def issue(ca: CaProcess, ttl_seconds: int = 3) -> list[str]:
    """Short leaves, so that the ones signed under A expire within the test."""
    token = ca.mint_token("default", "sleep")
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        return create_certificate(
            stub, build_csr(generate_private_key(), SLEEP), token=token, ttl_seconds=ttl_seconds
        )


def published(ca: CaProcess) -> set[str]:
    return {authority_id(c) for c in load_certs(ca.root_cert_path.read_bytes())}


def signed_by(ca: CaProcess, wanted: TestCa) -> bool:
    chain = issue(ca)
    verify_chain(
        [load_cert(c.encode()) for c in chain[:-1]],
        load_certs(ca.root_cert_path.read_bytes()),
        now=datetime.now(UTC),
    )
    return load_cert(chain[1].encode()) == wanted.cert


def test_root_change_in_steps_refuses_what_would_strand_workloads(tmp_path: Path):
    a, b = root(), root()
    ia, ia2, ib = intermediate(a), intermediate(a), intermediate(b)
    cacerts = tmp_path / "cacerts"
    ia.write_cacerts(cacerts, [a])
    ca = CaProcess(
        tmp_path / "data", "--cacerts-dir", str(cacerts), "--ca-reload-interval", "200ms"
    )
    ca.start()
    try:
        assert published(ca) == {authority_id(a.cert)}
        assert signed_by(ca, ia)

        # A new intermediate under the same root: a hot swap.
        ia2.write_cacerts(cacerts, [a])
        wait_for(lambda: signed_by(ca, ia2), 10, "the new intermediate to sign")

        # Jumping straight to B (not yet in anyone's bundle) is refused; A keeps signing.
        ib.write_cacerts(cacerts, [b])
        wait_for(
            lambda: "does not chain to a root workloads already have" in ca.log(), 10, "refusal"
        )
        assert "first add its root to root-cert.pem beside the current one" in ca.log()
        assert signed_by(ca, ia2) and published(ca) == {authority_id(a.cert)}

        # Step 1: both roots in the bundle, still signing under A.
        ia2.write_cacerts(cacerts, [a, b])
        wait_for(lambda: published(ca) == {authority_id(a.cert), authority_id(b.cert)}, 10, "A+B")
        # Long enough to outlive the next steps on a loaded machine, short enough to wait out.
        live_under_a = load_cert(issue(ca, ttl_seconds=15)[0].encode())

        # Step 2: signing under B, bundle still A+B.
        ib.write_cacerts(cacerts, [a, b])
        wait_for(lambda: signed_by(ca, ib), 10, "signing under B")

        # Step 3 too early: A still anchors a live leaf; refused, the CA keeps serving.
        ib.write_cacerts(cacerts, [b])
        wait_for(lambda: "unexpired leaves signed under it" in ca.log(), 10, "refusal")
        assert published(ca) == {authority_id(a.cert), authority_id(b.cert)}
        assert signed_by(ca, ib)
        assert datetime.now(UTC) < live_under_a.not_valid_after_utc

        # Once that leaf has expired the same change goes through by itself.
        wait_for(lambda: published(ca) == {authority_id(b.cert)}, 45, "B alone")
        assert datetime.now(UTC) >= live_under_a.not_valid_after_utc
        assert signed_by(ca, ib)
        assert ca.log().count("unexpired leaves signed under it") == 1, "logged once"
        audit = [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]
        changes = [
            (a["msg"], a.get("reason") or a.get("root"))
            for a in audit
            if a["msg"].startswith("authority-")
        ]
        a_id, b_id = authority_id(a.cert), authority_id(b.cert)
        assert changes == [
            ("authority-reloaded", a_id),  # new intermediate under A
            ("authority-change-refused", "signer-not-distributed"),
            ("authority-reloaded", a_id),  # bundle A+B
            ("authority-reloaded", b_id),  # signing under B
            ("authority-change-refused", "root-still-in-use"),
            ("authority-reloaded", b_id),  # B alone
        ]
    finally:
        ca.stop()


def _report_by_csr(
    ca: CaProcess, agent_id: str, bundle: list[TestCa], tokens: dict[str, str]
) -> None:
    """A CSR carrying the headers a meshca agent sends: its id and the bundle it serves. Each
    agent is its own pod, with one token (`tokens`, by agent id): a report counts for the pod
    the token is bound to."""
    token = tokens.get(agent_id) or tokens.setdefault(
        agent_id, ca.mint_token("default", "sleep", pod_name=agent_id)
    )
    headers = [
        (AGENT_ID_HEADER, agent_id),
        (TRUST_BUNDLE_HEADER, bundle_digest(root.cert for root in bundle)),
    ]
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        create_certificate(
            stub, build_csr(generate_private_key(), SLEEP), token=token, headers=headers
        )


def test_with_a_coverage_gate_signing_moves_to_a_new_root_once_the_agents_trust_it(
    tmp_path: Path,
):
    """`--activate-at-coverage` on a plugged-in CA: "published" is not "received". Moving the
    signer from A to B waits until that share of the reporting agents serve a bundle holding B;
    the CA keeps signing under A meanwhile, and takes the change by itself once they do."""
    a, b = root(), root()
    ia, ib = intermediate(a), intermediate(b)
    cacerts = tmp_path / "cacerts"
    ia.write_cacerts(cacerts, [a])
    ca = CaProcess(
        tmp_path / "data",
        "--cacerts-dir",
        str(cacerts),
        "--ca-reload-interval",
        "200ms",
        "--activate-at-coverage",
        "1.0",
    )
    ca.start()
    try:
        ia.write_cacerts(cacerts, [a, b])  # step 1 is not gated: the signer stays under A
        wait_for(lambda: published(ca) == {authority_id(a.cert), authority_id(b.cert)}, 10, "A+B")
        tokens: dict[str, str] = {}
        _report_by_csr(ca, "agent-1", [a, b], tokens)
        _report_by_csr(ca, "agent-2", [a], tokens)  # has not received the new bundle yet

        ib.write_cacerts(cacerts, [a, b])
        wait_for(lambda: "only 1/2 reporting agents trust it" in ca.log(), 10, "the gate")
        assert signed_by(ca, ia), "the CA keeps signing under A while the gate holds"
        assert "or restart the CA to take it now" in ca.log()

        _report_by_csr(ca, "agent-2", [a, b], tokens)
        wait_for(lambda: signed_by(ca, ib), 10, "signing under B once both agents trust it")
        audit = [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]
        changes = [
            (a["msg"], a.get("reason") or a.get("root"))
            for a in audit
            if a["msg"].startswith("authority-")
        ]
        assert changes == [
            ("authority-reloaded", authority_id(a.cert)),  # bundle A+B
            ("authority-change-refused", "signer-not-trusted-yet"),
            ("authority-reloaded", authority_id(b.cert)),  # signing under B
        ]
    finally:
        ca.stop()
