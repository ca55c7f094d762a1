"""The local development token issuer: lets the whole system run without a cluster.

It keeps an ECDSA key in `<data-dir>/dev-issuer/` and mints tokens shaped exactly like Kubernetes
projected service-account tokens (docs/reference.md#service-account-tokens), which the CA trusts in
local mode through the JWKS published beside the key. It is a stand-in for the API server, never
enabled by default when real issuers are configured.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from ca_server.config import DEFAULT_AUDIENCE, JwtIssuerConfig
from ca_server.jwt_authn import jwks_document
from certs import KeySpec, generate_private_key, load_private_key, private_key_to_pem
from meshca.files import atomic_write, ensure_dir

DEV_ISSUER = "meshca-dev-issuer"
_DIR = "dev-issuer"
_KEY = "signing-key.pem"
_JWKS = "jwks.json"


class DevIssuerMissing(RuntimeError):
    """The data directory has no development issuer yet."""


@dataclass(frozen=True)
class DevIssuer:
    key: ec.EllipticCurvePrivateKey
    kid: str
    directory: Path

    @property
    def jwks_path(self) -> Path:
        return self.directory / _JWKS

    def trust_config(self) -> JwtIssuerConfig:
        return JwtIssuerConfig(DEV_ISSUER, str(self.jwks_path), (DEFAULT_AUDIENCE,))

    def mint(
        self,
        namespace: str,
        service_account: str,
        *,
        audience: str = DEFAULT_AUDIENCE,
        ttl: timedelta = timedelta(hours=1),
        pod_name: str | None = None,
        now: float | None = None,
    ) -> str:
        """A signed token for `system:serviceaccount:<namespace>:<service_account>`."""
        issued = int(now if now is not None else time.time())
        pod = pod_name or f"{service_account}-dev"
        claims = {
            "iss": DEV_ISSUER,
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
            "aud": [audience],
            "iat": issued,
            "nbf": issued,
            "exp": issued + int(ttl.total_seconds()),
            "kubernetes.io": {
                "namespace": namespace,
                "serviceaccount": {"name": service_account, "uid": str(uuid.uuid4())},
                "pod": {"name": pod, "uid": str(uuid.uuid4())},
            },
        }
        return jwt.encode(claims, self.key, algorithm="ES256", headers={"kid": self.kid})


def ensure_dev_issuer(data_dir: Path) -> DevIssuer:
    """Loads the issuer from `data_dir`, creating key and JWKS on first use.

    Callers hold the data directory's lock (see `ca_server.authority.data_dir_lock`) so two CA
    processes starting together create one key.
    """
    directory = ensure_dir(data_dir / _DIR)
    key_path = directory / _KEY
    if not key_path.exists():
        key = generate_private_key(KeySpec("ECDSA", curve="P256"))
        atomic_write(key_path, private_key_to_pem(key), mode=0o600)
    issuer = load_dev_issuer(data_dir)
    jwk = ECAlgorithm.to_jwk(issuer.key.public_key(), as_dict=True)
    jwk.update({"kid": issuer.kid, "use": "sig", "alg": "ES256"})
    document = jwks_document([jwk])
    jwks_path = directory / _JWKS
    if not jwks_path.exists() or jwks_path.read_text() != document:
        atomic_write(jwks_path, document)
    return issuer


def load_dev_issuer(data_dir: Path) -> DevIssuer:
    directory = data_dir / _DIR
    key_path = directory / _KEY
    if not key_path.exists():
        raise DevIssuerMissing(
            f"{data_dir} has no development issuer yet: start `meshca ca --data-dir {data_dir}` "
            "once to initialize it"
        )
    key = load_private_key(key_path.read_bytes())
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise DevIssuerMissing(f"{key_path} is not an ECDSA key")
    return DevIssuer(key=key, kid=_key_id(key), directory=directory)


def _key_id(key: ec.EllipticCurvePrivateKey) -> str:
    """A stable key id: the RFC 7638 thumbprint of the public JWK (base64url SHA-256)."""
    jwk = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    canonical = json.dumps({k: jwk[k] for k in ("crv", "kty", "x", "y")}, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
