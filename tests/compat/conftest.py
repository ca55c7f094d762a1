"""The CAs the compatibility suite talks to: real `CertificateService`s served in-process over
real gRPC + TLS (`tests.support.inprocess_ca.InProcessCa`) with the mTLS renewal port open
(`--mtls-listen`), one per kind of authority an Istio mesh may bring
(`tests/support/ca_kinds.py`: self-signed, a root overlap, a plugged-in intermediate one or two
levels down, a plugged-in intermediate under a new root).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.ca_kinds import CA_KINDS, CaCert, authority_for
from tests.support.inprocess_ca import InProcessCa
from tests.support.token_issuer import RsaIssuer, make_rsa_issuer


@dataclass
class CompatCa:
    kind: str
    server: InProcessCa
    parts: dict[str, CaCert]


@pytest.fixture(scope="module", params=CA_KINDS)
def compat_ca(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CompatCa]:
    kind: str = request.param
    directory = Path(tmp_path_factory.mktemp(f"compat-{kind}"))
    authority, parts = authority_for(kind, directory / "cacerts")
    with InProcessCa(directory, authority=authority, mtls=True) as server:
        yield CompatCa(kind, server, parts)


@pytest.fixture(scope="module")
def untrusted_issuer(tmp_path_factory: pytest.TempPathFactory) -> RsaIssuer:
    """Signs tokens shaped like the cluster's that no CA here trusts (a stale or foreign key)."""
    return make_rsa_issuer(Path(tmp_path_factory.mktemp("untrusted-issuer")))


# Kubernetes mode (the fake API server and CA processes pointed at it), for what Istio's node
# agents do: the fixtures tests/k8s uses, shared as they are.
from tests.support.kube_mode import kube_api, kube_ca  # noqa: E402, F401
