"""The JWT authenticator's cache of verified tokens, in-process with a controllable clock."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from ca_server.authn import AuthnRequest
from ca_server.errors import AuthenticationError
from ca_server.jwt_authn import JwksFile, JwtAuthenticator, TrustedIssuer
from meshca.clock import FakeClock
from tests.ca_server.conftest import K8S_ISSUER, k8s_claims

START = datetime.now(UTC)


def _jwks(key: rsa.RSAPrivateKey, kid: str) -> str:
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": kid, "use": "sig", "alg": "RS256"})
    return json.dumps({"keys": [jwk]})


def test_a_withdrawn_jwks_key_stops_working_within_minutes_despite_the_cache(tmp_path: Path):
    """A leaked issuer key is withdrawn from the JWKS; tokens it signed (which may live a year)
    must not keep authenticating from the cache until they expire."""
    leaked, fresh = (rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in "ab")
    jwks = tmp_path / "jwks.json"
    jwks.write_text(_jwks(leaked, "leaked"))
    clock = FakeClock(START)
    authenticator = JwtAuthenticator(
        [TrustedIssuer(K8S_ISSUER, JwksFile(jwks), ("istio-ca",))], "cluster.local", clock
    )
    claims = k8s_claims("default", "sleep", lifetime=365 * 86400, issued_at=START.timestamp())
    token = jwt.encode(claims, leaked, algorithm="RS256", headers={"kid": "leaked"})
    request = AuthnRequest(headers={"authorization": f"Bearer {token}"})

    def authenticate() -> str:
        caller = asyncio.run(authenticator.authenticate(request))
        assert caller is not None
        return caller.identity.uri

    assert authenticate() == "spiffe://cluster.local/ns/default/sa/sleep"
    jwks.write_text(_jwks(fresh, "fresh"))
    clock.advance(timedelta(minutes=1))
    assert authenticate() == "spiffe://cluster.local/ns/default/sa/sleep"  # from the cache
    clock.advance(timedelta(minutes=5))  # the cache's clock; PyJWT checks exp in real time
    with pytest.raises(AuthenticationError, match="leaked"):
        authenticate()
