"""CSRs carrying the report headers a meshca agent sends (its id, the digest of the bundle it
serves, the authority of its leaf), over real gRPC to a real CA: the fleet a coverage test
needs without starting one agent per report."""

from __future__ import annotations

from collections.abc import Sequence

from ca_server.authn import Caller
from certs import SpiffeId, build_csr, generate_private_key
from meshca.wire import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER
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
    ca: CaProcess,
    headers: Sequence[tuple[str, str]],
    account: str = "sleep",
    token: str | None = None,
    namespace: str = "default",
) -> str:
    """One `CreateCertificate` for `default/account` with `headers` (none: an Istio-style
    caller, counted as unknown); raises `grpc.RpcError` if refused. Without `token`, a fresh
    one — a new pod as far as reports go; returns the token, to report again as that pod."""
    token = token or ca.mint_token(namespace, account)
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        csr = build_csr(generate_private_key(), SpiffeId("cluster.local", namespace, account))
        create_certificate(stub, csr, token=token, headers=headers)
    return token


def pod_caller(pod: str, uid: str | None = None, account: str = "sleep") -> Caller:
    """What an authenticator hands over for a token bound to pod `default/<pod>`: for tests
    that fill a CA's report table in process (`AgentReports.record_report`)."""
    return Caller(
        SpiffeId("cluster.local", "default", account),
        "test",
        subject=f"system:serviceaccount:default:{account}",
        pod_name=pod,
        pod_uid=uid or f"uid-{pod}",
    )
