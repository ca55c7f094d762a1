"""Where trust comes from: a JWKS served over HTTP, and roots of other key types."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from ca_server.dev_issuer import ensure_dev_issuer
from certs import SpiffeId, build_csr, generate_private_key, load_cert, load_certs, verify_chain
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.jwks_http import serve_jwks
from tests.support.token_issuer import K8S_ISSUER, RsaIssuer

pytestmark = pytest.mark.process  # every test runs a CA

SLEEP = SpiffeId("cluster.local", "default", "sleep")


@pytest.fixture
def jwks_url(rsa_issuer: RsaIssuer) -> Iterator[str]:
    with serve_jwks(rsa_issuer.jwks_path.read_bytes()) as url:
        yield url


def test_tokens_verified_against_a_jwks_url(tmp_path: Path, rsa_issuer: RsaIssuer, jwks_url: str):
    ca = CaProcess(tmp_path / "data", "--jwks", jwks_url, "--jwt-issuer", K8S_ISSUER)
    ca.start()
    try:
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            chain = create_certificate(
                stub,
                build_csr(generate_private_key(), SLEEP),
                token=rsa_issuer.token("default", "sleep"),
            )
        assert len(chain) == 2
        # With real issuers configured, the development issuer is not trusted.
        dev_token = ensure_dev_issuer(tmp_path / "elsewhere").mint("default", "sleep")
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            with pytest.raises(grpc.RpcError) as refused:
                create_certificate(stub, build_csr(generate_private_key(), SLEEP), token=dev_token)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        ca.stop()


@pytest.mark.parametrize("root_key", ["rsa-2048", "ec-p384"])
def test_generated_root_of_another_key_type(tmp_path: Path, root_key: str):
    ca = CaProcess(tmp_path / "data", "--root-key", root_key)
    ca.start()
    try:
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            chain = create_certificate(
                stub,
                build_csr(generate_private_key(), SLEEP),
                token=ca.mint_token("default", "sleep"),
            )
        roots = load_certs(ca.root_cert_path.read_bytes())
        assert isinstance(roots[0].public_key(), rsa.RSAPublicKey) == (root_key == "rsa-2048")
        verify_chain([load_cert(chain[0])], roots, now=datetime.now(UTC))
    finally:
        ca.stop()
