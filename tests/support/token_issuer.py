"""A token issuer for tests: an RS256 key standing in for a Kubernetes API server's
service-account signer, its JWKS file, and the claims of the projected tokens it signs.

The in-process CA, the CA process fixtures of tests/ca_server and the hostile, property and
fuzz tests all trust such an issuer with `--jwks`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

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
