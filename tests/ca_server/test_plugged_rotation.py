"""Done means (CA side of 2): a plugged-in root change A → A+B → signing under B → B alone,
through the cacerts directory of a running CA. A new intermediate under the same root is a hot
swap; a step that would strand workloads is refused with what to do, the current authority kept,
and the CA keeps serving; the refused step is taken once it becomes safe."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509

from ca_server.authority_slots import authority_id
from certs import (
    PrivateKey,
    SpiffeId,
    build_csr,
    build_intermediate_certificate,
    build_root_certificate,
    cert_to_pem,
    certs_to_pem,
    generate_private_key,
    load_cert,
    load_certs,
    private_key_to_pem,
    verify_chain,
)
from meshca.files import atomic_write
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import wait_for

SLEEP = SpiffeId("cluster.local", "default", "sleep")
NOW = datetime.now(UTC)


@dataclass(frozen=True)
class Ca:
    cert: x509.Certificate
    key: PrivateKey


def root(name: str) -> Ca:
    key = generate_private_key()
    cert = build_root_certificate(
        key, "cluster.local", now=NOW, lifetime=timedelta(days=30), common_name=name
    )
    return Ca(cert, key)


def intermediate(parent: Ca) -> Ca:
    key = generate_private_key()
    cert = build_intermediate_certificate(
        key.public_key(),
        parent.cert,
        parent.key,
        "cluster.local",
        now=NOW,
        lifetime=timedelta(days=7),
    )
    return Ca(cert, key)


def plug(directory: Path, signer: Ca, anchor: Ca, roots: list[Ca]) -> None:
    """Istio's cacerts layout; the root bundle last so a reader sees a consistent set soonest."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "ca-key.pem", private_key_to_pem(signer.key), mode=0o600)
    atomic_write(directory / "ca-cert.pem", cert_to_pem(signer.cert))
    atomic_write(directory / "cert-chain.pem", certs_to_pem([signer.cert, anchor.cert]))
    atomic_write(directory / "root-cert.pem", certs_to_pem([r.cert for r in roots]))


def issue(ca: CaProcess, ttl_seconds: int = 3) -> list[str]:
    """Short leaves, so that the ones signed under A expire within the test."""
    token = ca.mint_token("default", "sleep")
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        return create_certificate(
            stub, build_csr(generate_private_key(), SLEEP), token=token, ttl_seconds=ttl_seconds
        )


def published(ca: CaProcess) -> set[str]:
    return {authority_id(c) for c in load_certs(ca.root_cert_path.read_bytes())}


def signed_by(ca: CaProcess, wanted: Ca) -> bool:
    chain = issue(ca)
    verify_chain(
        [load_cert(c.encode()) for c in chain[:-1]],
        load_certs(ca.root_cert_path.read_bytes()),
        now=datetime.now(UTC),
    )
    return load_cert(chain[1].encode()) == wanted.cert


def test_root_change_in_steps_refuses_what_would_strand_workloads(tmp_path: Path):
    a, b = root("root A"), root("root B")
    ia, ia2, ib = intermediate(a), intermediate(a), intermediate(b)
    cacerts = tmp_path / "cacerts"
    plug(cacerts, ia, a, [a])
    ca = CaProcess(
        tmp_path / "data", "--cacerts-dir", str(cacerts), "--ca-reload-interval", "200ms"
    )
    ca.start()
    try:
        assert published(ca) == {authority_id(a.cert)}
        assert signed_by(ca, ia)

        # A new intermediate under the same root: a hot swap.
        plug(cacerts, ia2, a, [a])
        wait_for(lambda: signed_by(ca, ia2), 10, "the new intermediate to sign")

        # Jumping straight to B (not yet in anyone's bundle) is refused; A keeps signing.
        plug(cacerts, ib, b, [b])
        wait_for(
            lambda: "does not chain to a root workloads already have" in ca.log(), 10, "refusal"
        )
        assert "first add its root to root-cert.pem beside the current one" in ca.log()
        assert signed_by(ca, ia2) and published(ca) == {authority_id(a.cert)}

        # Step 1: both roots in the bundle, still signing under A.
        plug(cacerts, ia2, a, [a, b])
        wait_for(lambda: published(ca) == {authority_id(a.cert), authority_id(b.cert)}, 10, "A+B")
        live_under_a = load_cert(issue(ca, ttl_seconds=6)[0].encode())

        # Step 2: signing under B, bundle still A+B.
        plug(cacerts, ib, b, [a, b])
        wait_for(lambda: signed_by(ca, ib), 10, "signing under B")

        # Step 3 too early: A still anchors a live leaf; refused, the CA keeps serving.
        plug(cacerts, ib, b, [b])
        wait_for(lambda: "unexpired leaves signed under it" in ca.log(), 10, "refusal")
        assert published(ca) == {authority_id(a.cert), authority_id(b.cert)}
        assert signed_by(ca, ib)
        assert datetime.now(UTC) < live_under_a.not_valid_after_utc

        # Once that leaf has expired the same change goes through by itself.
        wait_for(lambda: published(ca) == {authority_id(b.cert)}, 30, "B alone")
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
