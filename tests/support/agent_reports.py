"""CSRs carrying the report headers a meshca agent sends (its id, the digest of the bundle it
serves, the authority of its leaf), over real gRPC to a real CA: the fleet a coverage test
needs without starting one agent per report."""

from __future__ import annotations

from collections.abc import Sequence

from certs import SpiffeId, build_csr, generate_private_key
from meshca.report_headers import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess


def report_headers(
    agent_id: str, bundle: str | None = None, leaf_authority: str | None = None
) -> list[tuple[str, str]]:
    headers = [(AGENT_ID_HEADER, agent_id)]
    if bundle is not None:
        headers.append((TRUST_BUNDLE_HEADER, bundle))
    if leaf_authority is not None:
        headers.append((LEAF_AUTHORITY_HEADER, leaf_authority))
    return headers


def reporting_csr(
    ca: CaProcess, headers: Sequence[tuple[str, str]], account: str = "sleep"
) -> None:
    """One `CreateCertificate` for `default/account` with `headers` (none: an Istio-style
    caller, counted as unknown); raises `grpc.RpcError` if refused."""
    token = ca.mint_token("default", account)
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        csr = build_csr(generate_private_key(), SpiffeId("cluster.local", "default", account))
        create_certificate(stub, csr, token=token, headers=headers)
