"""The refusal cases shared by the in-process table test and the process-level smoke test.

Each is one hostile or broken request with the gRPC status and a fragment of the message the
operator must see. `family` groups them (authn, authz, csr, impersonation).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs import SpiffeId, build_csr, generate_private_key
from tests.support import hostile_csr
from tests.support.token_issuer import RsaIssuer, k8s_claims

SLEEP = SpiffeId("cluster.local", "default", "sleep")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned_token(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"


@dataclass(frozen=True)
class Case:
    """One hostile or broken request, the status it must get and a fragment of its message."""

    name: str
    family: str  # authn, authz, csr, impersonation: one process-level smoke test each
    token: Callable[[RsaIssuer], str | None]
    csr: Callable[[], str]
    code: grpc.StatusCode
    message: str  # a fragment the operator-facing message must contain
    metadata: dict[str, Any] | None = None


def good_csr() -> str:
    return build_csr(generate_private_key(), SLEEP)


def good_token(issuer: RsaIssuer) -> str:
    return issuer.token("default", "sleep")


def _hs256_with_public_key(issuer: RsaIssuer) -> str:
    secret = issuer.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = _unsigned_token(
        {"alg": "HS256", "typ": "JWT", "kid": issuer.kid}, k8s_claims("default", "sleep")
    )
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


UNAUTH = grpc.StatusCode.UNAUTHENTICATED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
CASES = [
    Case("no token", "authn", lambda i: None, good_csr, UNAUTH, "no credential"),
    Case(
        "garbage token",
        "authn",
        lambda i: "garbage.not-a.jwt",
        good_csr,
        UNAUTH,
        "not a well-formed",
    ),
    Case(
        "expired token",
        "authn",
        lambda i: i.token("default", "sleep", issued_at=time.time() - 7200),
        good_csr,
        UNAUTH,
        "expired",
    ),
    Case(
        "token not yet valid",
        "authn",
        lambda i: i.token("default", "sleep", issued_at=time.time() + 3600),
        good_csr,
        UNAUTH,
        "not valid yet",
    ),
    Case(
        "wrong audience",
        "authn",
        lambda i: i.token("default", "sleep", audience="kubernetes"),
        good_csr,
        UNAUTH,
        "audience",
    ),
    Case(
        "wrong issuer",
        "authn",
        lambda i: i.token("default", "sleep", issuer="https://evil.example"),
        good_csr,
        UNAUTH,
        "not trusted",
    ),
    Case(
        "alg none",
        "authn",
        lambda i: (
            _unsigned_token({"alg": "none", "kid": i.kid}, k8s_claims("default", "sleep")) + "."
        ),
        good_csr,
        UNAUTH,
        "algorithm",
    ),
    Case(
        "HS256 keyed with the RSA public key",
        "authn",
        _hs256_with_public_key,
        good_csr,
        UNAUTH,
        "algorithm",
    ),
    Case(
        "unknown kid",
        "authn",
        lambda i: i.sign(k8s_claims("default", "sleep"), kid="rotated-away"),
        good_csr,
        UNAUTH,
        "rotated-away",
    ),
    Case(
        "kubernetes.io claim of the wrong shape",
        "authn",
        lambda i: i.sign({**k8s_claims("default", "sleep"), "kubernetes.io": "default"}),
        good_csr,
        UNAUTH,
        "not shaped like",
    ),
    Case(
        "token for another service account",
        "authz",
        lambda i: i.token("default", "other"),
        good_csr,
        grpc.StatusCode.PERMISSION_DENIED,
        "spiffe://cluster.local/ns/default/sa/other",
    ),
    Case(
        "CSR with an extra DNS SAN",
        "csr",
        good_token,
        lambda: hostile_csr.csr_with([hostile_csr.uri(SLEEP), x509.DNSName("evil.com")]),
        INVALID,
        "DNS",
    ),
    Case(
        "CSR with two URI SANs",
        "csr",
        good_token,
        lambda: hostile_csr.csr_with(
            [
                hostile_csr.uri(SLEEP),
                hostile_csr.uri("spiffe://cluster.local/ns/kube-system/sa/admin"),
            ]
        ),
        INVALID,
        "2 URI SANs",
    ),
    Case(
        "CSR with a second subjectAltName extension",
        "csr",
        good_token,
        lambda: hostile_csr.two_sans(SLEEP),
        INVALID,
        "Duplicate",
    ),
    Case(
        "CSR asking CA:true",
        "csr",
        good_token,
        hostile_csr.with_ca_true,
        INVALID,
        "CA:true",
    ),
    Case(
        "CSR signature does not verify",
        "csr",
        good_token,
        hostile_csr.broken_signature,
        INVALID,
        "signature",
    ),
    Case("non-PEM CSR", "csr", good_token, lambda: "this is not a CSR", INVALID, "not PEM"),
    Case(
        "CSR over 64 KiB",
        "csr",
        good_token,
        lambda: good_csr() + "\n" + "A" * (65 * 1024),
        INVALID,
        "limit",
    ),
    Case(
        "impersonation metadata",
        "impersonation",
        good_token,
        good_csr,
        UNAUTH,
        "impersonate",
        metadata={"ImpersonatedIdentity": "spiffe://cluster.local/ns/default/sa/other"},
    ),
]
