"""Bad input gets the right status, issues nothing, and the CA keeps serving (issue #2, item 3).

Each case sends one hostile or broken request to the same running CA, then checks the issued
counter did not move and a valid request still succeeds.
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
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs import SpiffeId, build_csr, generate_private_key
from tests.ca_server.conftest import RsaIssuer, k8s_claims
from tests.certs.helpers import csr_with_two_sans
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value

SLEEP = SpiffeId("cluster.local", "default", "sleep")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned_token(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"


def _csr_with(names: list[x509.GeneralName], *, ca: bool = False) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=True)
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    csr = builder.sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def _csr_with_broken_signature() -> str:
    pem = build_csr(generate_private_key(), SLEEP)
    der = bytearray(x509.load_pem_x509_csr(pem.encode()).public_bytes(serialization.Encoding.DER))
    der[-5] ^= 0xFF  # inside the signature value at the end of the structure
    body = base64.encodebytes(bytes(der)).decode()
    return f"-----BEGIN CERTIFICATE REQUEST-----\n{body}-----END CERTIFICATE REQUEST-----\n"


@dataclass(frozen=True)
class Case:
    name: str
    token: Callable[[CaProcess, RsaIssuer], str | None]
    csr: Callable[[], str]
    code: grpc.StatusCode
    message: str  # a fragment the operator-facing message must contain
    metadata: dict[str, Any] | None = None


def good_csr() -> str:
    return build_csr(generate_private_key(), SLEEP)


def good_token(ca: CaProcess, issuer: RsaIssuer) -> str:
    return issuer.token("default", "sleep")


def _hs256_with_public_key(ca: CaProcess, issuer: RsaIssuer) -> str:
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
    Case("no token", lambda ca, i: None, good_csr, UNAUTH, "no credential"),
    Case("garbage token", lambda ca, i: "garbage.not-a.jwt", good_csr, UNAUTH, "not a well-formed"),
    Case(
        "expired token",
        lambda ca, i: i.token("default", "sleep", issued_at=time.time() - 7200),
        good_csr,
        UNAUTH,
        "expired",
    ),
    Case(
        "token not yet valid",
        lambda ca, i: i.token("default", "sleep", issued_at=time.time() + 3600),
        good_csr,
        UNAUTH,
        "not valid yet",
    ),
    Case(
        "wrong audience",
        lambda ca, i: i.token("default", "sleep", audience="kubernetes"),
        good_csr,
        UNAUTH,
        "audience",
    ),
    Case(
        "wrong issuer",
        lambda ca, i: i.token("default", "sleep", issuer="https://evil.example"),
        good_csr,
        UNAUTH,
        "not trusted",
    ),
    Case(
        "alg none",
        lambda ca, i: (
            _unsigned_token({"alg": "none", "kid": i.kid}, k8s_claims("default", "sleep")) + "."
        ),
        good_csr,
        UNAUTH,
        "algorithm",
    ),
    Case(
        "HS256 keyed with the RSA public key", _hs256_with_public_key, good_csr, UNAUTH, "algorithm"
    ),
    Case(
        "unknown kid",
        lambda ca, i: i.sign(k8s_claims("default", "sleep"), kid="rotated-away"),
        good_csr,
        UNAUTH,
        "rotated-away",
    ),
    Case(
        "kubernetes.io claim of the wrong shape",
        lambda ca, i: i.sign({**k8s_claims("default", "sleep"), "kubernetes.io": "default"}),
        good_csr,
        UNAUTH,
        "not shaped like",
    ),
    Case(
        "token for another service account",
        lambda ca, i: i.token("default", "other"),
        good_csr,
        grpc.StatusCode.PERMISSION_DENIED,
        "spiffe://cluster.local/ns/default/sa/other",
    ),
    Case(
        "CSR with an extra DNS SAN",
        good_token,
        lambda: _csr_with([x509.UniformResourceIdentifier(SLEEP.uri), x509.DNSName("evil.com")]),
        INVALID,
        "DNS",
    ),
    Case(
        "CSR with two URI SANs",
        good_token,
        lambda: _csr_with(
            [
                x509.UniformResourceIdentifier(SLEEP.uri),
                x509.UniformResourceIdentifier("spiffe://cluster.local/ns/kube-system/sa/admin"),
            ]
        ),
        INVALID,
        "2 URI SANs",
    ),
    Case(
        "CSR with a second subjectAltName extension",
        good_token,
        lambda: csr_with_two_sans(SLEEP),
        INVALID,
        "Duplicate",
    ),
    Case(
        "CSR asking CA:true",
        good_token,
        lambda: _csr_with([x509.UniformResourceIdentifier(SLEEP.uri)], ca=True),
        INVALID,
        "CA:true",
    ),
    Case(
        "CSR signature does not verify",
        good_token,
        _csr_with_broken_signature,
        INVALID,
        "signature",
    ),
    Case("non-PEM CSR", good_token, lambda: "this is not a CSR", INVALID, "not PEM"),
    Case(
        "CSR over 64 KiB",
        good_token,
        lambda: good_csr() + "\n" + "A" * (65 * 1024),
        INVALID,
        "limit",
    ),
    Case(
        "impersonation metadata",
        good_token,
        good_csr,
        UNAUTH,
        "impersonate",
        metadata={"ImpersonatedIdentity": "spiffe://cluster.local/ns/default/sa/other"},
    ),
]


def _issued(ca: CaProcess) -> float:
    return sample_value(ca.metrics(), "meshca_ca_certificates_issued_total")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_with_the_right_status_and_nothing_issued(
    ca: CaProcess, root_pem: bytes, rsa_issuer: RsaIssuer, case: Case
):
    issued_before = _issued(ca)
    audit_before = ca.log().count('"outcome": "issued"')
    with ca_stub(ca.addr, root_pem) as stub:
        with pytest.raises(grpc.RpcError) as refused:
            create_certificate(
                stub, case.csr(), token=case.token(ca, rsa_issuer), metadata=case.metadata
            )
        assert refused.value.code() == case.code, refused.value.details()
        assert case.message in (refused.value.details() or "")
        assert _issued(ca) == issued_before
        assert ca.log().count('"outcome": "issued"') == audit_before
        # ... and the CA keeps serving valid requests.
        chain = create_certificate(stub, good_csr(), token=good_token(ca, rsa_issuer))
        assert len(chain) == 2
    assert _issued(ca) == issued_before + 1
