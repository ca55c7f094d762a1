"""The service-account token issuer: signing keys, OIDC discovery and the JWKS.

A real kube-apiserver signs projected service-account tokens with its
`--service-account-signing-key-file` and publishes the public keys at
``/.well-known/openid-configuration`` and ``/openid/v1/jwks`` (ServiceAccountIssuerDiscovery).
meshca's CA can verify those tokens offline against that JWKS, so the fake issues real JWTs of
the same shape — ``iss``, ``sub``, ``aud``, ``exp``/``iat``/``nbf`` and the ``kubernetes.io``
claim naming the namespace, service account and bound pod (names and uids) — and serves the two
documents. The same tokens are registered with the TokenReview table, so one token works in both
validation modes.

Keys can be rotated (`rotate`): the new key signs from then on, and the old one stays in the JWKS
(as kube-apiserver keeps every key given in `--service-account-key-file`) until `retire`d.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

DEFAULT_ISSUER = "https://kubernetes.default.svc.cluster.local"
DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/openid/v1/jwks"
ALGORITHM = "ES256"


def key_id(key: ec.EllipticCurvePrivateKey) -> str:
    """Like kube-apiserver: an unpadded base64url SHA-256 of the public key's DER."""
    der = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.urlsafe_b64encode(hashlib.sha256(der).digest()).rstrip(b"=").decode()


def public_jwk(key: ec.EllipticCurvePrivateKey) -> dict[str, Any]:
    jwk: dict[str, Any] = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": key_id(key), "use": "sig", "alg": ALGORITHM})
    return jwk


class ServiceAccountIssuer:
    """Signs projected service-account tokens and publishes their verification keys."""

    def __init__(self, issuer: str = DEFAULT_ISSUER) -> None:
        self.issuer = issuer
        self._lock = threading.Lock()
        self._signing = ec.generate_private_key(ec.SECP256R1())
        self._published: list[ec.EllipticCurvePrivateKey] = [self._signing]

    def discovery(self) -> dict[str, Any]:
        """The OIDC discovery document, as kube-apiserver serves it."""
        return {
            "issuer": self.issuer,
            "jwks_uri": f"{self.issuer}{JWKS_PATH}",
            "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": [ALGORITHM],
        }

    def jwks(self) -> dict[str, Any]:
        with self._lock:
            return {"keys": [public_jwk(key) for key in self._published]}

    def rotate(self) -> str:
        """A new signing key (published next to the old ones); returns its key id."""
        key = ec.generate_private_key(ec.SECP256R1())
        with self._lock:
            self._signing = key
            self._published.append(key)
        return key_id(key)

    def retire_all_but_current(self) -> None:
        """Withdraw every key except the current signing key from the JWKS."""
        with self._lock:
            self._published = [self._signing]

    @property
    def current_key_id(self) -> str:
        with self._lock:
            return key_id(self._signing)

    def sign(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: Sequence[str],
        pod_name: str | None = None,
        pod_uid: str | None = None,
        service_account_uid: str = "",
        lifetime: float = 3600.0,
        issued_at: float | None = None,
        signing_key: ec.EllipticCurvePrivateKey | None = None,
        issuer: str | None = None,
    ) -> str:
        """A token shaped like kubelet's projected ones (`signing_key`/`issuer` forge others)."""
        now = time.time() if issued_at is None else issued_at
        k8s: dict[str, Any] = {
            "namespace": namespace,
            "serviceaccount": {"name": service_account, "uid": service_account_uid},
        }
        if pod_name is not None:
            k8s["pod"] = {"name": pod_name, "uid": pod_uid or ""}
        claims = {
            "iss": issuer or self.issuer,
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
            "aud": list(audiences),
            "iat": int(now),
            "nbf": int(now),
            "exp": int(now + lifetime),
            "kubernetes.io": k8s,
        }
        with self._lock:
            key = signing_key or self._signing
        return jwt.encode(claims, key, algorithm=ALGORITHM, headers={"kid": key_id(key)})
