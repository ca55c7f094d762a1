"""Metrics move as requests predict; one audit line per request; no secrets in any log line;
private key files are 0600 (issue #2, item 4). Uses its own CA so counts start at zero."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from certs import SpiffeId, build_csr, generate_private_key, private_key_to_pem
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value

SLEEP = SpiffeId("cluster.local", "default", "sleep")


@pytest.fixture
def fresh_ca(tmp_path: Path, starts_processes: None) -> Iterator[CaProcess]:
    process = CaProcess(tmp_path / "data")
    process.start()
    yield process
    process.stop()


def _audit_lines(ca: CaProcess) -> list[dict[str, object]]:
    return [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]


def test_metrics_audit_and_logs(fresh_ca: CaProcess):
    ca = fresh_ca
    root = ca.root_cert_path.read_bytes()
    good = ca.mint_token("default", "sleep")
    other = ca.mint_token("default", "other")
    keys = [generate_private_key() for _ in range(4)]
    csrs = [build_csr(key, SLEEP) for key in keys]
    with ca_stub(ca.addr, root) as stub:
        for csr in csrs[:2]:
            create_certificate(stub, csr, token=good, ttl_seconds=600)
        refusals = [
            (csrs[2], None, grpc.StatusCode.UNAUTHENTICATED),
            (csrs[2], good + "x", grpc.StatusCode.UNAUTHENTICATED),
            (csrs[3], other, grpc.StatusCode.PERMISSION_DENIED),
            ("not a csr", good, grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for csr, token, code in refusals:
            with pytest.raises(grpc.RpcError) as refused:
                create_certificate(stub, csr, token=token)
            assert refused.value.code() == code

    metrics = ca.metrics()
    assert sample_value(metrics, "citadel_server_csr_count") == 6
    assert sample_value(metrics, "citadel_server_success_cert_issuance_count") == 2
    assert sample_value(metrics, "citadel_server_authentication_failure_count") == 2
    assert sample_value(metrics, "citadel_server_csr_sign_err_count") == 2
    assert (
        sample_value(
            metrics, "citadel_server_csr_sign_err_count", {"error": "csr-identity-mismatch"}
        )
        == 1
    )
    assert sample_value(metrics, "meshca_ca_denials_total", {"code": "INVALID_ARGUMENT"}) == 1
    assert sample_value(metrics, "meshca_ca_issuance_latency_seconds_count") == 2
    assert sample_value(metrics, "citadel_server_root_cert_expiry_timestamp") > 0
    assert sample_value(metrics, "citadel_server_cert_chain_expiry_timestamp") > 0

    audit = _audit_lines(ca)
    assert [line["outcome"] for line in audit] == ["issued"] * 2 + ["denied"] * 4
    issued = audit[0]
    assert issued["identity"] == SLEEP.uri
    assert issued["caller"] == "system:serviceaccount:default:sleep"
    assert issued["granted_ttl_seconds"] == 600
    assert isinstance(issued["serial"], str) and len(str(issued["serial"])) > 8
    assert {line["reason"] for line in audit[2:]} >= {"no-credentials", "csr-identity-mismatch"}

    # No token, no part of one, and no key material in any log line.
    log = ca.log()
    for token in (good, other):
        for part in token.split("."):
            assert part not in log
    for key in keys:
        assert private_key_to_pem(key).decode().splitlines()[1] not in log
    assert "PRIVATE KEY" not in log
    for csr in csrs:
        assert csr.splitlines()[1] not in log, "request bodies are not logged"


def test_private_key_files_are_owner_only(fresh_ca: CaProcess):
    for path in (
        fresh_ca.data_dir / "ca-key.pem",
        fresh_ca.data_dir / "dev-issuer" / "signing-key.pem",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
