"""meshca's own agent renewing over mTLS (`--prov-cert`, Istio's `PROV_CERT`) against a real
`meshca ca --mtls-listen` process, with a token the CA does not trust in its token file: only
the provisioning certificate can authenticate, and the CA's audit lines must say it did.

The provisioning certificate is issued once over the TLS port (as an operator provisions a VM)
and written as the agent would present it: meshca's `cert-chain.pem` (leaf + intermediates)
and Istio's (leaf + intermediates + root bundle); under a self-signed root, Istio's file is the
leaf + the root.
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from certs import SpiffeId, describe_certificate, load_certs, verify_chain
from tests.support.agent_process import AgentProcess
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_kinds import new_intermediate, new_root, write_cacerts
from tests.support.ca_process import CaProcess
from tests.support.istio_wire import istio_cert_chain_pem, istio_csr, istio_key, key_pem
from tests.support.kube_mode import audit_lines
from tests.support.processes import free_port, wait_for
from tests.support.token_issuer import make_rsa_issuer

pytestmark = pytest.mark.process  # every test runs a CA and an agent


def _issued_lines(ca: CaProcess, identity: str) -> list[dict[str, Any]]:
    return [
        line
        for line in audit_lines(ca)
        if line.get("outcome") == "issued" and line["identity"] == identity
    ]


def _provisioning_dir(directory: Path, ca: CaProcess, identity: SpiffeId, *, istio: bool) -> Path:
    """`cert-chain.pem` + `key.pem` of a one-hour certificate for `identity`, issued with a
    valid token over the TLS port; Istio's file appends the root bundle, meshca's does not."""
    key = istio_key("ec-p256")
    token = ca.mint_token(identity.namespace, identity.service_account)
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        chain = create_certificate(stub, istio_csr(identity, key), token=token, ttl_seconds=3600)
    directory.mkdir(parents=True)
    (directory / "key.pem").write_bytes(key_pem(key))
    (directory / "cert-chain.pem").write_bytes(istio_cert_chain_pem(chain if istio else chain[:-1]))
    return directory


def _agent_over_mtls(
    workdir: Path, ca: CaProcess, mtls_addr: str, service_account: str, prov: Path
) -> AgentProcess:
    agent = AgentProcess(
        workdir,
        ca,
        service_account,
        secret_ttl="4s",
        # The later --ca-addr wins: the mTLS renewal port instead of the TLS one.
        extra_args=("--ca-addr", mtls_addr, "--prov-cert", str(prov)),
    )
    # A well-formed service-account token signed by a key the CA does not know.
    untrusted = make_rsa_issuer(agent.directory)
    agent.token_path.write_text(untrusted.token(agent.namespace, service_account))
    return agent


def _renews_by_certificate(ca: CaProcess, agent: AgentProcess) -> None:
    """The agent's first certificate and a renewal, both authenticated by the client
    certificate (the provisioning one's identity), and the leaf it serves verifies."""
    wait_for(lambda: len(_issued_lines(ca, agent.identity)) >= 3, 20, "a renewal over mTLS")
    issued = _issued_lines(ca, agent.identity)
    # The first was the provisioning certificate (token over TLS), the rest over mTLS.
    assert issued[0]["authenticator"] != "client-certificate"
    for line in issued[1:]:
        assert line["authenticator"] == "client-certificate", line
        assert line["caller"] == f"x509:{agent.identity}"
    leaf = agent.wait_file_leaf()
    assert describe_certificate(leaf).identity == agent.identity
    chain = load_certs((agent.output_dir / "cert-chain.pem").read_bytes())
    verify_chain(chain, load_certs(ca.root_cert_path.read_bytes()), now=datetime.now(UTC))


def test_agent_renews_over_mtls_under_a_plugged_in_intermediate(tmp_path: Path):
    now = datetime.now(UTC)
    root = new_root(now)
    mesh = new_intermediate(root, "mesh intermediate", now)
    cacerts = write_cacerts(tmp_path / "cacerts", mesh, [mesh.cert, root.cert], [root.cert])
    mtls_addr = f"127.0.0.1:{free_port()}"
    ca = CaProcess(tmp_path / "data", "--cacerts-dir", str(cacerts), "--mtls-listen", mtls_addr)
    ca.start()
    agents: list[AgentProcess] = []
    short = tempfile.TemporaryDirectory(dir="/tmp", prefix="prov-")  # SDS paths <= 107 bytes
    try:
        for service_account, istio in (("sleep", False), ("httpbin", True)):
            identity = SpiffeId("cluster.local", "default", service_account)
            prov = _provisioning_dir(
                tmp_path / f"prov-{service_account}", ca, identity, istio=istio
            )
            agents.append(_agent_over_mtls(Path(short.name), ca, mtls_addr, service_account, prov))
        for agent in agents:
            agent.launch()
        for agent in agents:
            agent.wait_ready()
            _renews_by_certificate(ca, agent)
    finally:
        for agent in agents:
            agent.stop()
        ca.stop()
        short.cleanup()


def test_agent_renews_over_mtls_presenting_leaf_and_root(tmp_path: Path):
    mtls_addr = f"127.0.0.1:{free_port()}"
    ca = CaProcess(tmp_path / "data", "--mtls-listen", mtls_addr)
    ca.start()
    short = tempfile.TemporaryDirectory(dir="/tmp", prefix="prov-")  # SDS paths <= 107 bytes
    try:
        identity = SpiffeId("cluster.local", "default", "sleep")
        prov = _provisioning_dir(tmp_path / "prov", ca, identity, istio=True)
        assert len(load_certs((prov / "cert-chain.pem").read_bytes())) == 2  # leaf + root
        agent = _agent_over_mtls(Path(short.name), ca, mtls_addr, "sleep", prov)
        agent.start()
        try:
            _renews_by_certificate(ca, agent)
        finally:
            agent.stop()
    finally:
        ca.stop()
        short.cleanup()


def test_agent_renews_with_the_certificate_it_was_last_issued_when_prov_cert_is_its_output(
    tmp_path: Path,
):
    """Istio's VM pattern: `PROV_CERT` is `OUTPUT_CERTS`, so each renewal over mTLS presents
    the certificate of the renewal before it. The provisioning certificate lives 6 s; renewals
    must go on, authenticated by the client certificate, well past its expiry — the agent
    follows the files instead of presenting the first certificate until the CA refuses it."""
    mtls_addr = f"127.0.0.1:{free_port()}"
    ca = CaProcess(tmp_path / "data", "--mtls-listen", mtls_addr)
    ca.start()
    short = tempfile.TemporaryDirectory(dir="/tmp", prefix="prov-")  # SDS paths <= 107 bytes
    try:
        identity = SpiffeId("cluster.local", "default", "sleep")
        key = istio_key("ec-p256")
        token = ca.mint_token(identity.namespace, identity.service_account)
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            chain = create_certificate(stub, istio_csr(identity, key), token=token, ttl_seconds=6)
        provisioned_until = load_certs(chain[0].encode())[0].not_valid_after_utc
        output = Path(short.name) / "sleep" / "certs"  # AgentProcess's --output-dir
        output.mkdir(parents=True)
        (output / "key.pem").write_bytes(key_pem(key))
        (output / "cert-chain.pem").write_bytes(istio_cert_chain_pem(chain))
        agent = AgentProcess(
            Path(short.name),
            ca,
            "sleep",
            secret_ttl="3s",
            extra_args=("--ca-addr", mtls_addr, "--prov-cert", str(output)),
        )
        assert agent.output_dir == output
        untrusted = make_rsa_issuer(agent.directory)
        agent.token_path.write_text(untrusted.token(agent.namespace, "sleep"))
        agent.start()
        try:
            wait_for(
                lambda: (
                    datetime.now(UTC) > provisioned_until.replace(microsecond=0)
                    and len(_issued_lines(ca, agent.identity)) >= 8
                ),
                40,
                "renewals over mTLS past the provisioning certificate's expiry",
            )
            issued = _issued_lines(ca, agent.identity)
            assert all(line["authenticator"] == "client-certificate" for line in issued[1:])
            refused = [
                line
                for line in audit_lines(ca)
                if line.get("outcome") != "issued" and line.get("identity") == agent.identity
            ]
            assert not refused, refused
            leaf = agent.wait_file_leaf()
            assert leaf.not_valid_after_utc > provisioned_until
        finally:
            agent.stop()
    finally:
        ca.stop()
        short.cleanup()
