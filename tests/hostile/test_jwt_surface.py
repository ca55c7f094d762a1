"""Hostile bearer tokens against the JWKS authenticator: algorithm and key confusion, claim
smuggling, encoding tricks, size extremes; plus issue #11 item 7's JWKS read off the loop."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from ca_server.authn import AuthnRequest
from ca_server.errors import AuthenticationError
from ca_server.jwt_authn import JwksFile, JwtAuthenticator, TrustedIssuer
from meshca.clock import SystemClock
from tests.hostile.loop_stall import longest_stall
from tests.support.inprocess_ca import KID, InProcessCa, good_csr, refused
from tests.support.token_issuer import K8S_ISSUER, k8s_claims

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"


def _claims(**changes: Any) -> dict[str, Any]:
    claims = k8s_claims("default", "sleep")
    claims.update(changes)
    return {key: value for key, value in claims.items() if value is not None}


def _hs256_keyed_with_public_key(hostile_ca: InProcessCa) -> str:
    secret = hostile_ca.issuer.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = _unsigned({"alg": "HS256", "typ": "JWT", "kid": KID}, _claims())
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


_ATTACKER_RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
_ATTACKER_EC = ec.generate_private_key(ec.SECP256R1())


def _embedded_jwk(hostile_ca: InProcessCa) -> str:
    """Key confusion: signed by the attacker, who puts their own public key in the header."""
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(_ATTACKER_RSA.public_key()))
    return jwt.encode(_claims(), _ATTACKER_RSA, "RS256", headers={"kid": KID, "jwk": public})


def _jku_header(hostile_ca: InProcessCa) -> str:
    return jwt.encode(
        _claims(), _ATTACKER_RSA, "RS256", headers={"kid": KID, "jku": "http://127.0.0.1:1/k"}
    )


def _swap_payload(hostile_ca: InProcessCa) -> str:
    """A valid token's signature over another payload (claim smuggling by splicing)."""
    header, _, signature = hostile_ca.issuer.token("default", "sleep").split(".")
    forged = _b64(json.dumps(k8s_claims("kube-system", "admin")).encode())
    return f"{header}.{forged}.{signature}"


def _duplicate_sub_keys(hostile_ca: InProcessCa) -> str:
    """JSON with `sub` twice: parsers disagree on which wins; the signature covers the bytes."""
    body = json.dumps(_claims())[:-1] + ', "sub": "system:serviceaccount:kube-system:admin"}'
    header = _b64(json.dumps({"alg": "RS256", "kid": KID, "typ": "JWT"}).encode())
    signing_input = f"{header}.{_b64(body.encode())}"
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    signature = hostile_ca.issuer.key.sign(
        signing_input.encode(), padding.PKCS1v15(), hashes.SHA256()
    )
    return f"{signing_input}.{_b64(signature)}"


def _now() -> int:
    return int(time.time())


TokenMaker = Callable[[InProcessCa], str]
# (name, token maker, status, message fragment)
CASES: list[tuple[str, TokenMaker, grpc.StatusCode, str]] = [
    (
        "alg none",
        lambda hostile_ca: _unsigned({"alg": "none", "kid": KID}, _claims()) + ".",
        UNAUTH,
        "algorithm",
    ),
    (
        "alg None spelled oddly",
        lambda hostile_ca: _unsigned({"alg": "nOnE", "kid": KID}, _claims()) + ".",
        UNAUTH,
        "algorithm",
    ),
    ("HS256 keyed with the public key", _hs256_keyed_with_public_key, UNAUTH, "algorithm"),
    (
        "signed by another RSA key",
        lambda hostile_ca: jwt.encode(_claims(), _ATTACKER_RSA, "RS256", headers={"kid": KID}),
        UNAUTH,
        "signature",
    ),
    (
        "ES256 by an attacker key",
        lambda hostile_ca: jwt.encode(_claims(), _ATTACKER_EC, "ES256", headers={"kid": KID}),
        UNAUTH,
        "",
    ),
    ("embedded jwk header", _embedded_jwk, UNAUTH, "signature"),
    ("jku header", _jku_header, UNAUTH, "signature"),
    ("payload swapped under a valid signature", _swap_payload, UNAUTH, "signature"),
    ("duplicate sub key", _duplicate_sub_keys, UNAUTH, ""),
    (
        "unknown kid",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(), kid="rotated-away"),
        UNAUTH,
        "rotated-away",
    ),
    (
        "kid path traversal",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(), kid="../../etc/passwd"),
        UNAUTH,
        "key id",
    ),
    (
        "expired",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(exp=_now() - 3600)),
        UNAUTH,
        "expired",
    ),
    (
        "not yet valid",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(nbf=_now() + 3600)),
        UNAUTH,
        "not valid yet",
    ),
    ("no exp", lambda hostile_ca: hostile_ca.issuer.sign(_claims(exp=None)), UNAUTH, "exp"),
    (
        "exp as a string",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(exp="tomorrow")),
        UNAUTH,
        "",
    ),
    (
        "wrong audience",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(aud=["kubernetes"])),
        UNAUTH,
        "audience",
    ),
    ("no audience", lambda hostile_ca: hostile_ca.issuer.sign(_claims(aud=None)), UNAUTH, "aud"),
    (
        "untrusted issuer",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(iss="https://evil.example")),
        UNAUTH,
        "not trusted",
    ),
    (
        "issuer with trailing slash",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(iss=K8S_ISSUER + "/")),
        UNAUTH,
        "not trusted",
    ),
    (
        "sub not a service account",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(sub="system:admin")),
        UNAUTH,
        "not a service account",
    ),
    (
        "sub with an extra colon",
        lambda hostile_ca: hostile_ca.issuer.sign(
            _claims(sub="system:serviceaccount:default:sleep:x")
        ),
        UNAUTH,
        "not a service account",
    ),
    (
        "sub namespace not a DNS label",
        lambda hostile_ca: hostile_ca.issuer.sign(
            _claims(sub="system:serviceaccount:../x:sleep", **{"kubernetes.io": None})
        ),
        UNAUTH,
        "subject",
    ),
    (
        "kubernetes.io disagrees with sub",
        lambda hostile_ca: hostile_ca.issuer.sign(
            _claims(sub="system:serviceaccount:kube-system:admin")
        ),
        UNAUTH,
        "disagrees",
    ),
    (
        "kubernetes.io of the wrong shape",
        lambda hostile_ca: hostile_ca.issuer.sign(_claims(**{"kubernetes.io": ["default"]})),
        UNAUTH,
        "not shaped like",
    ),
    (
        "another service account",
        lambda hostile_ca: hostile_ca.issuer.token("default", "other"),
        DENIED,
        "sa/other",
    ),
    ("two dots only", lambda hostile_ca: "..", UNAUTH, "not a well-formed"),
    (
        "6 KB of base64",
        lambda hostile_ca: "eyJ" + "A" * 6000 + ".e30.x",
        UNAUTH,
        "not a well-formed",
    ),
    (
        "token with an inner space",
        lambda hostile_ca: hostile_ca.issuer.token("default", "sleep") + " extra",
        UNAUTH,
        "",
    ),
]


@pytest.mark.parametrize(
    ("make", "code", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_token_is_refused(
    hostile_ca: InProcessCa, make: TokenMaker, code: grpc.StatusCode, fragment: str
) -> None:
    token = make(hostile_ca)
    refused(hostile_ca, lambda: hostile_ca.call(good_csr(), token=token), code, fragment)


def test_refused_token_is_not_echoed_in_the_message_or_audit(hostile_ca: InProcessCa) -> None:
    token = hostile_ca.issuer.sign(_claims(aud=["kubernetes"]))
    details = refused(
        hostile_ca, lambda: hostile_ca.call(good_csr(), token=token), UNAUTH, "audience"
    )
    assert token not in details
    signature = token.rsplit(".", 1)[1]
    assert all(signature not in json.dumps(line) for line in hostile_ca.audit.lines)


# --- JWKS file reads off the event loop (issue #11 item 7) -----------------------------------


def test_jwks_file_replaced_by_a_fifo_does_not_block_the_loop(tmp_path: Path) -> None:
    """Before: the JWKS was opened and read on the event loop, so a FIFO (or a stuck mount)
    blocked every request until a writer appeared. Now the read runs in a thread, refuses
    anything that is not a regular file, and the loop keeps running."""
    fifo = tmp_path / "jwks.json"
    os.mkfifo(fifo)
    authenticator = JwtAuthenticator(
        [TrustedIssuer(K8S_ISSUER, JwksFile(fifo), ("istio-ca",))],
        "cluster.local",
        SystemClock(),
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    token = jwt.encode(_claims(), key, "RS256", headers={"kid": KID})

    def late_writer() -> None:  # unblocks an open() on the loop, so the old code ends too
        time.sleep(1.5)
        try:  # fails with ENXIO when no reader is blocked on the FIFO (the fixed code)
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        os.write(fd, b'{"keys": []}')
        os.close(fd)

    writer = threading.Thread(target=late_writer, daemon=True)
    writer.start()

    request = AuthnRequest(headers={"authorization": f"Bearer {token}"})
    outcome, longest_gap = asyncio.run(longest_stall(authenticator.authenticate(request)))
    writer.join(5)
    assert longest_gap < 0.5, f"the event loop stalled for {longest_gap:.2f}s"
    assert isinstance(outcome, AuthenticationError)
    assert "not a regular file" in outcome.message


def test_a_signed_token_expiring_in_year_10000_is_not_a_server_error(
    hostile_ca: InProcessCa,
) -> None:
    """Found by tests/hostile/test_properties.py: an `exp` beyond what a datetime holds made
    the cache's expiry computation raise, and the CA answered INTERNAL with a traceback."""
    token = hostile_ca.issuer.sign(_claims(exp=253402300800))
    issued_before = hostile_ca.issued_count()
    chain = hostile_ca.call(good_csr(), token=token)
    assert chain and hostile_ca.issued_count() == issued_before + 1


class _StuckJwks(JwksFile):
    """A JWKS file whose read hangs until released, as one on a dead mount does."""

    calls = 0
    release = threading.Event()

    def _current_keys(self) -> jwt.PyJWKSet:
        type(self).calls += 1
        self.release.wait(10)
        raise OSError("released")


def test_a_stuck_jwks_read_is_shared_not_repeated(tmp_path: Path) -> None:
    """Twenty requests during a stuck JWKS read each get jwks-unavailable after the timeout,
    and all of them wait on one read (one blocked thread), not twenty."""
    source = _StuckJwks(tmp_path / "jwks.json", read_timeout=0.2)

    async def attempt() -> str:
        try:
            await source.key_for(KID)
        except AuthenticationError as exc:
            return exc.message
        return "a key was returned"

    async def scenario() -> list[str]:
        first = await asyncio.gather(*(attempt() for _ in range(10)))
        second = await asyncio.gather(*(attempt() for _ in range(10)))  # still stuck
        _StuckJwks.release.set()  # let the thread end before the loop shuts its executor
        return [*first, *second]

    messages = asyncio.run(scenario())
    assert len(messages) == 20 and all("did not finish within" in m for m in messages)
    assert _StuckJwks.calls == 1
