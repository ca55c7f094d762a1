"""The JWT authenticator's cache of verified tokens, in-process with a controllable clock."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from ca_server.authn import AuthnRequest
from ca_server.errors import AuthenticationError
from ca_server.jwt_authn import JwksFile, JwksUrl, JwtAuthenticator, TrustedIssuer
from meshca.clock import FakeClock
from tests.support.jwks_http import serve_jwks
from tests.support.token_issuer import K8S_ISSUER, k8s_claims

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
    # The CA gives the key source its clock too (`key_source_for`): the file is looked at
    # again once the set is a second old, on the same clock as the cache.
    source = JwksFile(jwks, monotonic=clock.monotonic)
    authenticator = JwtAuthenticator(
        [TrustedIssuer(K8S_ISSUER, source, ("istio-ca",))], "cluster.local", clock
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


def _first_step(coroutine: Any) -> tuple[bool, Any]:
    """Runs one step of `coroutine` on a loop: (finished in it, its value)."""

    async def step() -> tuple[bool, Any]:
        try:
            coroutine.send(None)
        except StopIteration as done:
            return True, done.value
        coroutine.close()
        return False, None

    return asyncio.run(step())


def _answers_inline_only_from_a_fresh_set(source: Any, clock: FakeClock) -> None:
    """`source` (a JwksFile or JwksUrl knowing key `k1`) goes to its file or URL for its first
    lookup, answers `k1` in the first step while its set is under a second old, and goes back
    for a key id the set lacks or once the set is a second old."""
    assert _first_step(source.key_for("k1"))[0] is False  # nothing read yet
    assert asyncio.run(source.key_for("k1")).key_id == "k1"
    finished, found = _first_step(source.key_for("k1"))
    assert finished and found.key_id == "k1"
    assert _first_step(source.key_for("k2"))[0] is False  # a key id it lacks
    clock.advance(1.0)
    assert _first_step(source.key_for("k1"))[0] is False  # a second old: read again


def test_a_jwks_file_read_a_moment_ago_answers_without_waiting(tmp_path: Path):
    """A new token whose key is in the set read less than a second ago is verified in one
    step: no worker thread, nothing for the completion-queue server to hand to the loop (a
    storm of new development tokens stays on its thread). A key id the set lacks, or a set a
    second old, sends the lookup back to the file."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks = tmp_path / "jwks.json"
    jwks.write_text(_jwks(key, "k1"))
    clock = FakeClock(START)
    _answers_inline_only_from_a_fresh_set(JwksFile(jwks, monotonic=clock.monotonic), clock)


def test_a_jwks_url_fetched_a_moment_ago_answers_without_waiting():
    """The same for a JWKS URL, served over HTTP on loopback (its client's cache still needs a
    worker thread per call)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    clock = FakeClock(START)
    with serve_jwks(_jwks(key, "k1").encode()) as url:
        _answers_inline_only_from_a_fresh_set(JwksUrl(url, monotonic=clock.monotonic), clock)
