"""Done means (CA side): a real `meshca ca` with a 40-second root rotates by itself — prepared,
active, old dropped — with every leaf verifying against the published bundle throughout; and a
CA SIGKILLed between prepare and activate resumes with the same prepared key."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509

from ca_server.authority.slots import authority_id
from certs import (
    CLOCK_SKEW_BACKDATE,
    SpiffeId,
    build_csr,
    generate_private_key,
    load_cert,
    load_certs,
    private_key_to_pem,
    verify_chain,
)
from meshca.taint_notice import TAINT_NOTICE_NAME, decode_taint_notice
from tests.support.authority_cli import authority_rows, data_dir_target, meshca_authority
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.processes import free_port, wait_for

pytestmark = pytest.mark.process  # every test runs a CA

SLEEP = SpiffeId("cluster.local", "default", "sleep")


def authority(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return meshca_authority(data_dir_target(data_dir), *args)


def show(data_dir: Path) -> list[dict[str, Any]]:
    return authority_rows(data_dir_target(data_dir))


def phases(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {row["id"]: row["state"] for row in rows}


def issuer_id(leaf: x509.Certificate) -> str:
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier is not None
    return aki.key_identifier.hex()


def issue(ca: CaProcess, token: str, ttl_seconds: int = 0) -> list[str]:
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        return create_certificate(
            stub, build_csr(generate_private_key(), SLEEP), token=token, ttl_seconds=ttl_seconds
        )


def renew_over_mtls(ca: CaProcess, mtls_port: int, key: Any, chain_pem: bytes) -> list[str]:
    """A renewal as Istio's agent sends it: no token, `chain_pem` (its leaf first) and `key` as
    the client certificate on the CA's `--mtls-listen` port."""
    with ca_stub(
        f"127.0.0.1:{mtls_port}",
        ca.root_cert_path.read_bytes(),
        client_key_pem=private_key_to_pem(key),
        client_chain_pem=chain_pem,
    ) as stub:
        return create_certificate(stub, build_csr(generate_private_key(), SLEEP))


@contextlib.contextmanager
def ca_with_an_mtls_port(tmp_path: Path) -> Iterator[tuple[CaProcess, int]]:
    """A running local CA with an mTLS renewal port, reloading its state every 200 ms."""
    mtls_port = free_port()
    ca = CaProcess(
        tmp_path / "data",
        "--mtls-listen",
        f"127.0.0.1:{mtls_port}",
        "--ca-reload-interval",
        "200ms",
    )
    ca.start()
    try:
        yield ca, mtls_port
    finally:
        ca.stop()


@dataclass
class Observed:
    """What the test saw, in order: bundles published, who signed each leaf, the phases."""

    bundles: list[tuple[str, ...]] = field(default_factory=list)
    signers: list[str] = field(default_factory=list)
    phase_sets: list[dict[str, str]] = field(default_factory=list)
    leaves: list[x509.Certificate] = field(default_factory=list)
    response_bundles: list[frozenset[str]] = field(default_factory=list)

    def note(self, seq: list[Any], item: Any) -> None:
        if not seq or seq[-1] != item:
            seq.append(item)


def test_a_short_lived_root_rotates_by_itself_and_every_leaf_keeps_verifying(tmp_path: Path):
    # 40 s: prepared at 20 s, active at 33 s, the first authority dropped at 40 s.
    ca = CaProcess(tmp_path / "data", "--root-ttl", "40s", "--ca-reload-interval", "1s")
    ca.start()
    try:
        first = show(ca.data_dir)
        assert [row["state"] for row in first] == ["active"]
        first_id = first[0]["id"]
        token = ca.mint_token("default", "sleep", ttl="10m")
        seen = Observed()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            bundle_certs = load_certs(ca.root_cert_path.read_bytes())
            bundle = tuple(authority_id(c) for c in bundle_certs)
            seen.note(seen.bundles, bundle)
            now = datetime.now(UTC)
            # Every unexpired leaf issued so far verifies against what is published now.
            for leaf in seen.leaves:
                if leaf.not_valid_after_utc > now:
                    verify_chain([leaf], bundle_certs, now=now)
            chain = issue(ca, token, ttl_seconds=3600)
            leaf = load_cert(chain[0].encode())
            verify_chain([leaf], load_certs(chain[-1].encode()), now=now)
            seen.leaves.append(leaf)
            seen.note(seen.signers, issuer_id(leaf))
            in_response = frozenset(authority_id(c) for c in load_certs(chain[-1].encode()))
            seen.note(seen.response_bundles, in_response)
            seen.note(seen.phase_sets, phases(show(ca.data_dir)))
            if first_id not in bundle and len(seen.bundles) >= 3:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"no full cycle within the deadline: {seen}\n{ca.log()}")

        # Bundles: {A} → {A, B} (prepared, published at once) → {B} (A dropped).
        second_id = next(i for b in seen.bundles for i in b if i != first_id)
        assert seen.bundles[0] == (first_id,)
        assert set(seen.bundles[1]) == {first_id, second_id}
        assert first_id not in seen.bundles[-1] and second_id in seen.bundles[-1]
        # CreateCertificate responses carry the same bundles, {A, B} included.
        assert [set(b) for b in seen.response_bundles[:2]] == [
            {first_id},
            {first_id, second_id},
        ]
        # Signers: A until activation, then B; never A again.
        assert seen.signers[:2] == [first_id, second_id], seen.signers
        # Phases as `meshca authority show` reported them, in order.
        wanted = [
            {first_id: "active"},
            {first_id: "active", second_id: "prepared"},
            {second_id: "active", first_id: "old"},
        ]
        observed = [p for p in seen.phase_sets if set(p) <= {first_id, second_id}]
        assert observed[:3] == wanted, seen.phase_sets
        assert first_id not in seen.phase_sets[-1]
        # Leaves were capped at the activation lead (40 s / 6), so none was cut short.
        lifetimes = {
            (leaf.not_valid_after_utc - leaf.not_valid_before_utc - CLOCK_SKEW_BACKDATE)
            for leaf in seen.leaves
        }
        # (+1 s: X.509 times have whole seconds)
        assert max(lifetimes) <= timedelta(seconds=40 / 6 + 1), lifetimes
        # Each phase change is an audit line, and the gauges follow.
        audit = [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]
        events = [
            (a["msg"], a.get("authority")) for a in audit if a["msg"].startswith("authority-")
        ]
        for event in (
            ("authority-prepared", second_id),
            ("authority-activated", second_id),
            ("authority-retired", first_id),
            ("authority-dropped", first_id),
        ):
            assert event in events, events
        metrics = ca.metrics()
        assert (
            sample_value(
                metrics, "meshca_ca_authority_phase", {"authority": second_id, "phase": "active"}
            )
            == 1
        )
        assert (
            sample_value(
                metrics, "meshca_ca_authority_not_after_timestamp", {"authority": first_id}
            )
            == 0
        )
        active_not_after = datetime.fromisoformat(
            next(r["not_after"] for r in show(ca.data_dir) if r["state"] == "active")
        )
        assert (
            sample_value(metrics, "citadel_server_root_cert_expiry_timestamp")
            == active_not_after.timestamp()
        )
    finally:
        ca.stop()


def test_sigkill_between_prepare_and_activate_resumes_with_the_same_prepared_key(
    tmp_path: Path,
):
    args = (
        "--root-ttl",
        "15s",
        "--ca-reload-interval",
        "1s",
    )  # prepared at 7.5 s, active at 12.5 s
    ca = CaProcess(tmp_path / "data", *args)
    ca.start()
    try:
        wait_for(lambda: len(show(ca.data_dir)) == 2, 40, "a prepared authority")
        rows = phases(show(ca.data_dir))
        prepared = next(i for i, state in rows.items() if state == "prepared")
        key_before = (ca.data_dir / "authorities.json").read_text()
    finally:
        ca.kill()
    assert "prepared" in key_before

    again = CaProcess(tmp_path / "data", *args)
    again.start()
    try:
        assert phases(show(again.data_dir)).get(prepared) in ("prepared", "active")
        wait_for(
            lambda: phases(show(again.data_dir)).get(prepared) == "active",
            30,
            "the prepared authority to become active",
        )
        token = again.mint_token("default", "sleep")
        leaf = load_cert(issue(again, token)[0].encode())
        assert issuer_id(leaf) == prepared, "the same prepared key signs after the restart"
    finally:
        again.stop()


def test_forced_rotation_and_taint_reach_a_running_ca(tmp_path: Path):
    """prepare + activate + taint through `meshca authority` while the CA runs: it signs with
    the new authority, and once the old one is tainted a client certificate it signed no longer
    authenticates a renewal over mTLS; revoke removes it from root-cert.pem."""
    with ca_with_an_mtls_port(tmp_path) as (ca, mtls_port):
        token = ca.mint_token("default", "sleep")
        old_key = generate_private_key()
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            old_chain = create_certificate(stub, build_csr(old_key, SLEEP), token=token)
        (old,) = show(ca.data_dir)

        def renew(key: Any, chain: list[str]) -> list[str]:
            return renew_over_mtls(ca, mtls_port, key, chain[0].encode())

        assert authority(ca.data_dir, "prepare").returncode == 0
        new = next(r["id"] for r in show(ca.data_dir) if r["state"] == "prepared")
        assert authority(ca.data_dir, "activate", new).returncode == 0
        wait_for(
            lambda: issuer_id(load_cert(issue(ca, token)[0].encode())) == new,
            5,
            "the CA to sign with the activated authority",
        )
        assert issuer_id(load_cert(renew(old_key, old_chain)[0].encode())) == new, (
            "an untainted old authority still vouches for its leaves"
        )

        assert authority(ca.data_dir, "taint", old["id"]).returncode == 0

        def refused() -> bool:
            try:
                renew(old_key, old_chain)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                return True
            return False

        wait_for(refused, 5, "the tainted authority's client certificate to be refused")
        new_key = generate_private_key()
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            new_chain = create_certificate(stub, build_csr(new_key, SLEEP), token=token)
        assert issuer_id(load_cert(renew(new_key, new_chain)[0].encode())) == new

        assert old["id"] in {authority_id(c) for c in load_certs(ca.root_cert_path.read_bytes())}
        assert authority(ca.data_dir, "revoke", old["id"]).returncode == 0
        wait_for(
            lambda: {authority_id(c) for c in load_certs(ca.root_cert_path.read_bytes())} == {new},
            5,
            "root-cert.pem without the revoked authority",
        )
        audit = [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]
        assert any(
            a.get("reason") == "client-certificate-untrusted" or a.get("outcome") == "denied"
            for a in audit
        )


def test_a_tainted_authoritys_client_certificate_is_refused_naming_the_taint(tmp_path: Path):
    """A renewal over mTLS with a leaf of a tainted authority is refused (UNAUTHENTICATED, as
    before) saying which authority was tainted and when, and that a token gets a new
    certificate — whether the client sends its leaf alone or, as Istio's agent does, followed
    by its whole bundle. Before: "... a root this CA does not trust", as for any stranger."""
    with ca_with_an_mtls_port(tmp_path) as (ca, mtls_port):
        token = ca.mint_token("default", "sleep")
        old_key = generate_private_key()
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            old_chain = create_certificate(stub, build_csr(old_key, SLEEP), token=token)
        (old,) = show(ca.data_dir)
        assert authority(ca.data_dir, "prepare").returncode == 0
        new = next(r["id"] for r in show(ca.data_dir) if r["state"] == "prepared")
        assert authority(ca.data_dir, "activate", new).returncode == 0
        assert authority(ca.data_dir, "taint", old["id"]).returncode == 0
        notice = ca.data_dir / TAINT_NOTICE_NAME
        tainted_at = decode_taint_notice(notice.read_bytes())[old["id"]]
        leaf_alone = old_chain[0].encode()
        with_bundle = leaf_alone + ca.root_cert_path.read_bytes()

        def refusal(chain_pem: bytes) -> str | None:
            try:
                renew_over_mtls(ca, mtls_port, old_key, chain_pem)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                return str(exc.details())
            return None

        wait_for(lambda: refusal(leaf_alone) is not None, 5, "the tainted leaf to be refused")
        for chain_pem in (leaf_alone, with_bundle):
            details = refusal(chain_pem)
            assert details is not None
            when = f"{tainted_at:%Y-%m-%dT%H:%M:%SZ}"
            assert f"signed by authority {old['id']}, which this CA tainted at {when}" in details
            assert "request a new certificate with the workload's token" in details
            assert "does not trust" not in details
