"""Fixtures for the CA tests: a real `meshca ca` process trusting the dev issuer and an RSA
"Kubernetes" issuer whose JWKS file the tests control."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from tests.support.ca_process import CaProcess

K8S_ISSUER = "https://kubernetes.default.svc.cluster.local"


def k8s_claims(
    namespace: str,
    service_account: str,
    *,
    issuer: str = K8S_ISSUER,
    audience: str = "istio-ca",
    lifetime: int = 3600,
    issued_at: float | None = None,
) -> dict[str, Any]:
    """Claims of a Kubernetes projected service-account token.

    Shape: docs/reference.md#service-account-tokens."""
    now = int(issued_at if issued_at is not None else time.time())
    return {
        "iss": issuer,
        "sub": f"system:serviceaccount:{namespace}:{service_account}",
        "aud": [audience],
        "iat": now,
        "nbf": now,
        "exp": now + lifetime,
        "kubernetes.io": {
            "namespace": namespace,
            "serviceaccount": {"name": service_account, "uid": "sa-uid"},
            "pod": {"name": f"{service_account}-pod", "uid": "pod-uid"},
        },
    }


@dataclass
class RsaIssuer:
    """An RS256 issuer standing in for a Kubernetes API server's service-account signer."""

    key: rsa.RSAPrivateKey
    kid: str
    jwks_path: Path

    def sign(self, claims: dict[str, Any], *, kid: str | None = None) -> str:
        return jwt.encode(claims, self.key, algorithm="RS256", headers={"kid": kid or self.kid})

    def token(self, namespace: str, service_account: str, **kwargs: Any) -> str:
        return self.sign(k8s_claims(namespace, service_account, **kwargs))


def make_rsa_issuer(directory: Path, kid: str = "k8s-key-1") -> RsaIssuer:
    """A new RS256 issuer whose JWKS (one key, `kid`) is written to `directory/jwks.json`."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": kid, "use": "sig", "alg": "RS256"})
    path = directory / "jwks.json"
    path.write_text(json.dumps({"keys": [jwk]}))
    return RsaIssuer(key, kid, path)


@pytest.fixture(scope="module")
def rsa_issuer(tmp_path_factory: pytest.TempPathFactory) -> RsaIssuer:
    return make_rsa_issuer(tmp_path_factory.mktemp("issuer"))


@pytest.fixture(scope="module")
def ca(
    tmp_path_factory: pytest.TempPathFactory, rsa_issuer: RsaIssuer, starts_processes: None
) -> Iterator[CaProcess]:
    process = CaProcess(
        tmp_path_factory.mktemp("ca") / "data",
        "--jwks",
        str(rsa_issuer.jwks_path),
        "--jwt-issuer",
        K8S_ISSUER,
        "--dev-issuer",
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def root_pem(ca: CaProcess) -> bytes:
    return ca.root_cert_path.read_bytes()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp for tests that start agents: their SDS socket paths must
    stay under 107 bytes, which pytest's long tmp_path does not."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mcs-") as path:
        yield Path(path)
