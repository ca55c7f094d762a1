"""The CA as a process: restarts, signals, shared data directories, plugged-in CAs, mTLS renewal.
Each test starts its own CA processes on fresh ports and data directories."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from certs import (
    PrivateKey,
    SpiffeId,
    build_csr,
    build_intermediate_certificate,
    build_root_certificate,
    cert_to_pem,
    generate_private_key,
    load_cert,
    load_certs,
    private_key_to_pem,
    verify_chain,
)
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import child_env, wait_for

pytestmark = pytest.mark.process  # every test runs a CA

SLEEP = SpiffeId("cluster.local", "default", "sleep")


def _issue(ca: CaProcess, identity: SpiffeId = SLEEP, **kwargs) -> list[str]:
    token = ca.mint_token(identity.namespace, identity.service_account)
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        return create_certificate(
            stub, build_csr(generate_private_key(), identity), token=token, **kwargs
        )


def _verifies(chain: list[str], root_path: Path) -> None:
    certs_in_chain = [load_cert(pem) for pem in chain[:-1]]
    verify_chain(certs_in_chain, load_certs(root_path.read_bytes()), now=datetime.now(UTC))


def test_restart_reuses_the_root_and_sigterm_exits_fast(tmp_path: Path):
    ca = CaProcess(tmp_path / "data")
    ca.start()
    root_before = ca.root_cert_path.read_bytes()
    chain = _issue(ca)
    started = time.monotonic()
    assert ca.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 5, "SIGTERM must end the CA within 5 s"

    again = CaProcess(tmp_path / "data")
    again.start()
    try:
        assert again.root_cert_path.read_bytes() == root_before
        _verifies(chain, again.root_cert_path)
        _verifies(_issue(again), again.root_cert_path)
    finally:
        again.stop()


def test_restart_after_sigkill_is_clean(tmp_path: Path):
    ca = CaProcess(tmp_path / "data")
    ca.start()
    root_before = ca.root_cert_path.read_bytes()
    ca.kill()
    leftovers = [p.name for p in (tmp_path / "data").rglob("*.tmp")]
    assert leftovers == []
    again = CaProcess(tmp_path / "data")
    again.start()
    try:
        assert again.root_cert_path.read_bytes() == root_before
        _verifies(_issue(again), again.root_cert_path)
    finally:
        again.stop()


def test_two_processes_sharing_a_data_dir_share_one_root(tmp_path: Path):
    first, second = CaProcess(tmp_path / "data"), CaProcess(tmp_path / "data")
    for ca in (first, second):  # both start before either is ready
        super(CaProcess, ca).start()
    try:
        for ca in (first, second):
            wait_for(ca._ready, 30, "CA ready")
        root = (tmp_path / "data" / "root-cert.pem").read_bytes()
        assert len(load_certs(root)) == 1
        for ca in (first, second):
            _verifies(_issue(ca), ca.root_cert_path)
    finally:
        first.stop()
        second.stop()


def _new_root() -> tuple[x509.Certificate, PrivateKey]:
    key = generate_private_key()
    cert = build_root_certificate(
        key,
        "cluster.local",
        now=datetime.now(UTC),
        lifetime=timedelta(days=365),
        common_name="corp root",
    )
    return cert, key


def _write_plugged_ca(
    directory: Path, layout: str, root_ca: tuple[x509.Certificate, PrivateKey] | None = None
) -> tuple[bytes, bytes]:
    """Root (new unless given) → a new intermediate, written in Istio's `cacerts` layout or the
    `tls.*` one."""
    now = datetime.now(UTC)
    root, root_key = root_ca or _new_root()
    key = generate_private_key()
    intermediate = build_intermediate_certificate(
        key.public_key(), root, root_key, "cluster.local", now=now, lifetime=timedelta(days=30)
    )
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "istio":
        (directory / "ca-cert.pem").write_text(cert_to_pem(intermediate))
        (directory / "ca-key.pem").write_bytes(private_key_to_pem(key))
        (directory / "root-cert.pem").write_text(cert_to_pem(root))
        (directory / "cert-chain.pem").write_text(cert_to_pem(intermediate) + cert_to_pem(root))
    else:
        (directory / "tls.crt").write_text(cert_to_pem(intermediate))
        (directory / "tls.key").write_bytes(private_key_to_pem(key))
        (directory / "ca.crt").write_text(cert_to_pem(root))
    return cert_to_pem(root).encode(), cert_to_pem(intermediate).encode()


@pytest.mark.parametrize("layout", ["istio", "tls"])
def test_plugged_in_ca_gives_leaf_intermediate_root(tmp_path: Path, layout: str):
    root_pem, intermediate_pem = _write_plugged_ca(tmp_path / "cacerts", layout)
    ca = CaProcess(tmp_path / "data", "--cacerts-dir", str(tmp_path / "cacerts"))
    ca.start()
    try:
        assert ca.root_cert_path.read_bytes() == root_pem
        chain = _issue(ca)
        assert len(chain) == 3, "[leaf, intermediate, root bundle]"
        assert chain[1].encode() == intermediate_pem
        assert chain[2].encode() == root_pem
        _verifies(chain, ca.root_cert_path)
        leaf = load_cert(chain[0])
        assert leaf.not_valid_after_utc <= load_cert(intermediate_pem).not_valid_after_utc
    finally:
        ca.stop()


def test_incomplete_plugged_in_ca_refuses_to_start_and_names_what_is_missing(tmp_path: Path):
    _write_plugged_ca(tmp_path / "cacerts", "istio")
    (tmp_path / "cacerts" / "ca-key.pem").unlink()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshca",
            "ca",
            "--data-dir",
            str(tmp_path / "data"),
            "--cacerts-dir",
            str(tmp_path / "cacerts"),
            "--listen",
            "127.0.0.1:0",
            "--monitoring-listen",
            "127.0.0.1:0",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "missing ['ca-key.pem']" in result.stderr


def test_plugged_in_ca_change_is_picked_up_without_restart(tmp_path: Path):
    """A new intermediate under the same root (a new root goes in steps: see
    `test_plugged_rotation.py`)."""
    root_ca = _new_root()
    _write_plugged_ca(tmp_path / "cacerts", "istio", root_ca)
    ca = CaProcess(
        tmp_path / "data",
        "--cacerts-dir",
        str(tmp_path / "cacerts"),
        "--ca-reload-interval",
        "200ms",
    )
    ca.start()
    try:
        root_pem, new_intermediate = _write_plugged_ca(tmp_path / "cacerts", "istio", root_ca)
        wait_for(lambda: _issue(ca)[1].encode() == new_intermediate, 10, "hot swap")
        assert ca.root_cert_path.read_bytes() == root_pem
        chain = _issue(ca)
        _verifies(chain, ca.root_cert_path)
        # A broken update is refused and the current CA kept.
        (tmp_path / "cacerts" / "ca-key.pem").write_bytes(
            private_key_to_pem(generate_private_key())
        )
        wait_for(lambda: "keeping the current CA" in ca.log(), 10, "broken update refused")
        assert _issue(ca)[1].encode() == new_intermediate
    finally:
        ca.stop()


def test_renewal_over_mtls_uses_the_client_certificate_identity(tmp_path: Path):
    from tests.support.processes import free_port

    mtls_port = free_port()
    ca = CaProcess(tmp_path / "data", "--mtls-listen", f"127.0.0.1:{mtls_port}")
    ca.start()
    try:
        key = generate_private_key()
        token = ca.mint_token("default", "sleep")
        root = ca.root_cert_path.read_bytes()
        with ca_stub(ca.addr, root) as stub:
            chain = create_certificate(stub, build_csr(key, SLEEP), token=token)
        with ca_stub(
            f"127.0.0.1:{mtls_port}",
            root,
            client_key_pem=private_key_to_pem(key),
            client_chain_pem=chain[0].encode(),
        ) as stub:
            renewed = create_certificate(stub, build_csr(generate_private_key(), SLEEP))
            assert load_cert(renewed[0]).serial_number != load_cert(chain[0]).serial_number
            other = SpiffeId("cluster.local", "default", "other")
            with pytest.raises(grpc.RpcError) as refused:
                create_certificate(stub, build_csr(generate_private_key(), other))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert '"authenticator": "client-certificate"' in ca.log()
    finally:
        ca.stop()


def test_inspect_prints_identity_serial_and_time_left(tmp_path: Path):
    ca = CaProcess(tmp_path / "data")
    ca.start()
    try:
        chain = _issue(ca, ttl_seconds=3600)
    finally:
        ca.stop()
    leaf_path = tmp_path / "leaf.pem"
    leaf_path.write_text(chain[0])
    result = subprocess.run(
        [sys.executable, "-m", "meshca", "inspect", str(leaf_path)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert SLEEP.uri in result.stdout
    assert format(load_cert(chain[0]).serial_number, "x") in result.stdout
    assert "time left:  59m" in result.stdout or "time left:  1h" in result.stdout
