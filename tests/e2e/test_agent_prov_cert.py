"""meshca's own agent renewing over mTLS (`--prov-cert`, Istio's `PROV_CERT`) against a real
`meshca ca --mtls-listen` process, with a token the CA does not trust in its token file: only
the provisioning certificate can authenticate, and the CA's audit lines must say it did.

The provisioning certificate is issued once over the TLS port (as an operator provisions a VM)
and written as the agent would present it: meshca's `cert-chain.pem` (leaf + intermediates)
and Istio's (leaf + intermediates + root bundle); under a self-signed root, Istio's file is the
leaf + the root.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from certs import SpiffeId, describe_certificate, load_certs, verify_chain
from tests.ca_server.conftest import make_rsa_issuer
from tests.compat.conftest import new_intermediate, new_root, write_cacerts
from tests.compat.istio_wire import istio_cert_chain_pem, istio_csr, istio_key, key_pem
from tests.support.agent_process import AgentProcess
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import free_port, wait_for


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """The agents' directories: their SDS socket paths must stay under 107 bytes."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="prov-") as path:
        yield Path(path)


def _issued_lines(ca: CaProcess, identity: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]
    return [
        line for line in lines if line.get("outcome") == "issued" and line["identity"] == identity
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


def test_agent_renews_over_mtls_under_a_plugged_in_intermediate(tmp_path: Path, short_dir: Path):
    now = datetime.now(UTC)
    root = new_root(now)
    mesh = new_intermediate(root, "mesh intermediate", now)
    cacerts = write_cacerts(tmp_path / "cacerts", mesh, [mesh.cert, root.cert], [root.cert])
    mtls_addr = f"127.0.0.1:{free_port()}"
    ca = CaProcess(tmp_path / "data", "--cacerts-dir", str(cacerts), "--mtls-listen", mtls_addr)
    ca.start()
    agents: list[AgentProcess] = []
    try:
        for service_account, istio in (("sleep", False), ("httpbin", True)):
            identity = SpiffeId("cluster.local", "default", service_account)
            prov = _provisioning_dir(
                tmp_path / f"prov-{service_account}", ca, identity, istio=istio
            )
            agents.append(_agent_over_mtls(short_dir, ca, mtls_addr, service_account, prov))
        for agent in agents:
            agent.launch()
        for agent in agents:
            agent.wait_ready()
            _renews_by_certificate(ca, agent)
    finally:
        for agent in agents:
            agent.stop()
        ca.stop()


def test_agent_renews_over_mtls_presenting_leaf_and_root(tmp_path: Path, short_dir: Path):
    mtls_addr = f"127.0.0.1:{free_port()}"
    ca = CaProcess(tmp_path / "data", "--mtls-listen", mtls_addr)
    ca.start()
    try:
        identity = SpiffeId("cluster.local", "default", "sleep")
        prov = _provisioning_dir(tmp_path / "prov", ca, identity, istio=True)
        assert len(load_certs((prov / "cert-chain.pem").read_bytes())) == 2  # leaf + root
        agent = _agent_over_mtls(short_dir, ca, mtls_addr, "sleep", prov)
        agent.start()
        try:
            _renews_by_certificate(ca, agent)
        finally:
            agent.stop()
    finally:
        ca.stop()
