"""Kubernetes mode for tests: a fake API server (in-thread), real `meshca ca` processes pointed
at it with `--kubeconfig`, the check that the CA only makes the declared API calls, and the
helpers those tests share (issue a certificate, read the audit lines, verify a chain).

The fixtures `kube_api` and `kube_ca` are registered where they are used by importing them into
a folder's `conftest.py` (tests/k8s, tests/compat). The "every granted rule is used" check of a
full tests/k8s run stays in `tests/k8s/conftest.py`; it reads `RULES_NEEDED`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from certs import SpiffeId, build_csr, generate_private_key, load_certs, verify_chain
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.deploy_rbac import Rule, is_allowed
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import (
    CA_NAMESPACE,
    CA_RBAC,
    POD_CERTIFICATE_RBAC,
    contract_rules,
    describe,
    required_rules,
)

# The rules the Kubernetes-mode tests of this process needed so far (each `kube_api` adds its
# own); a full run of tests/k8s compares them with `CA_RBAC` (`tests/k8s/conftest.py`).
RULES_NEEDED: set[Rule] = set()


@pytest.fixture
def kube_api(starts_processes: None) -> Iterator[KubeApiServer]:
    """A fake API server with the CA's namespace; fails the test if the CA made an API call
    that `CA_RBAC` and `POD_CERTIFICATE_RBAC` (and so deploy/'s RBAC with the pod-certificates
    overlay) do not allow."""
    server = KubeApiServer().start()
    server.create_namespace(CA_NAMESPACE)
    try:
        yield server
        needed = required_rules(server.requests(), CA_NAMESPACE)
        RULES_NEEDED.update(contract_rules(CA_RBAC, needed))
        allowed = set(CA_RBAC | POD_CERTIFICATE_RBAC)
        denied = {rule for rule in needed if not is_allowed(allowed, rule)}
        assert not denied, f"API calls the RBAC does not allow: {describe(denied)}"
    finally:
        server.stop()


CaFactory = Callable[..., CaProcess]


@pytest.fixture
def kube_ca(tmp_path: Path, kube_api: KubeApiServer, starts_processes: None) -> Iterator[CaFactory]:
    """`kube_ca("name", *args, start=True)`: a CA in Kubernetes mode against `kube_api`,
    identified as instance `name` (its API user agent is `meshca-ca/<name>`)."""
    started: list[CaProcess] = []
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")

    def make(name: str = "ca-0", *args: str, start: bool = True) -> CaProcess:
        ca = CaProcess(
            tmp_path / name,
            "--kubeconfig",
            str(kubeconfig),
            "--instance-id",
            name,
            *args,
        )
        started.append(ca)
        if start:
            ca.start()
        return ca

    try:
        yield make
    finally:
        for ca in started:
            ca.stop()


def issue(
    ca: CaProcess,
    token: str,
    identity: str,
    *,
    metadata: dict[str, Any] | None = None,
    headers: tuple[tuple[str, str], ...] = (),
    tls_roots: bytes | None = None,
) -> list[str]:
    """CreateCertificate for `identity` (a SPIFFE URI); returns the chain or raises RpcError.

    The CA's TLS certificate is verified with its published root, or `tls_roots`."""
    csr = build_csr(generate_private_key(), SpiffeId.parse(identity))
    with ca_stub(ca.addr, tls_roots or ca.root_cert_path.read_bytes()) as stub:
        return create_certificate(stub, csr, token=token, metadata=metadata, headers=headers)


def assert_verifies(chain: list[str], root_pem: bytes) -> None:
    certificates = [cert for element in chain[:-1] for cert in load_certs(element.encode())]
    verify_chain(certificates, load_certs(root_pem), now=datetime.now(UTC))


def rpc_code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    return error.code(), error.details()


def audit_lines(ca: CaProcess) -> list[dict[str, Any]]:
    lines = []
    for line in ca.log().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def spiffe(namespace: str, service_account: str) -> str:
    return f"spiffe://cluster.local/ns/{namespace}/sa/{service_account}"
