"""Hostile CSRs: each refused with the exact status, nothing issued, the CA still serving.

Includes issue #11's items 3 (refusal messages bounded however many or long the SANs are) and
4 (concatenated PEM blocks refused instead of the first one being read)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from tests.support import hostile_csr as b
from tests.support.inprocess_ca import InProcessCa, refused

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DENIED = grpc.StatusCode.PERMISSION_DENIED

# (name, CSR builder, status, fragment of the message, audit/metric reason)
CASES: list[tuple[str, Callable[[], str], grpc.StatusCode, str, str]] = [
    ("extra IP SAN", b.ip_san, INVALID, "IP SAN", "csr-extra-sans"),
    ("extra email SAN", b.email_san, INVALID, "email SAN", "csr-extra-sans"),
    ("registered-id SAN", b.other_name_san, INVALID, "other-name", "csr-extra-sans"),
    ("wildcard DNS SAN", b.wildcard_dns, INVALID, "DNS SAN", "csr-extra-sans"),
    ("no SAN at all", b.no_san, INVALID, "no URI SAN", "csr-no-identity"),
    (
        "another workload's identity",
        b.other_identity,
        DENIED,
        "own identity",
        "csr-identity-mismatch",
    ),
    ("another trust domain", b.other_trust_domain, DENIED, "own identity", "csr-identity-mismatch"),
    ("URI with a query", b.uri_with_query, DENIED, "own identity", "csr-identity-mismatch"),
    ("URI case changed", b.uri_case_changed, DENIED, "own identity", "csr-identity-mismatch"),
    (
        "URI with dot segments",
        b.uri_with_dot_segments,
        DENIED,
        "own identity",
        "csr-identity-mismatch",
    ),
    ("URI with a NUL byte", b.uri_with_nul, DENIED, "own identity", "csr-identity-mismatch"),
    ("CA:true", b.with_ca_true, INVALID, "CA:true", "csr-asks-ca"),
    ("keyCertSign usage", b.with_key_cert_sign, INVALID, "keyCertSign", "csr-asks-ca"),
    ("name constraints", b.with_name_constraints, INVALID, "nameConstraints", "csr-extensions"),
    ("RSA-1024 key", b.rsa_1024, INVALID, "RSA-1024", "csr-weak-key"),
    ("P-521 key", b.p521, INVALID, "secp521r1", "csr-key-type"),
    ("secp256k1 key", b.secp256k1, INVALID, "secp256k1", "csr-key-type"),
    ("Ed25519 key", b.ed25519_key, INVALID, "not supported", "csr-key-type"),
    ("DSA key", b.dsa_key, INVALID, "not supported", "csr-key-type"),
    ("broken signature", b.broken_signature, INVALID, "signature", "csr-invalid"),
    ("base64 DER without armor", b.der_as_base64_without_armor, INVALID, "not PEM", "csr-invalid"),
    ("CERTIFICATE armor", b.armor_swapped_to_certificate, INVALID, "not PEM", "csr-invalid"),
    ("truncated PEM", b.truncated_pem, INVALID, "END CERTIFICATE REQUEST", "csr-invalid"),
    ("unknown CSR version", b.unknown_version, INVALID, "not a valid CSR version", "csr-invalid"),
    ("body not base64", b.body_not_base64, INVALID, "PKCS#10", "csr-invalid"),
    ("body not a CSR", b.body_is_not_asn1, INVALID, "PKCS#10", "csr-invalid"),
    ("two CSRs concatenated", b.concatenated_two_csrs, INVALID, "2 PEM blocks", "csr-invalid"),
    ("CSR then a private key", b.csr_then_private_key, INVALID, "2 PEM blocks", "csr-invalid"),
    ("text before the block", b.text_before_block, INVALID, "around the PEM", "csr-invalid"),
    ("empty csr", lambda: "", INVALID, "not PEM", "csr-invalid"),
    (
        "over 64 KiB",
        lambda: b.csr_with([b.uri()]) + "\n" * (65 * 1024),
        INVALID,
        "limit",
        "csr-invalid",
    ),
    ("300 DNS SANs", lambda: b.many_dns_sans(300), INVALID, "300 DNS SAN(s)", "csr-extra-sans"),
    (
        "30 KB URI SAN",
        lambda: b.long_uri_san(30_000),
        DENIED,
        "own identity",
        "csr-identity-mismatch",
    ),
]


@pytest.mark.parametrize(
    ("builder", "code", "fragment", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_hostile_csr_is_refused(
    hostile_ca: InProcessCa,
    builder: Callable[[], str],
    code: grpc.StatusCode,
    fragment: str,
    reason: str,
) -> None:
    csr = builder()
    refused(
        hostile_ca,
        lambda: hostile_ca.call(csr, token=hostile_ca.issuer.token("default", "sleep")),
        code,
        fragment,
        reason=reason,
    )


def test_refusal_for_hundreds_of_sans_is_short_and_still_says_what_to_fix(
    hostile_ca: InProcessCa,
) -> None:
    """Item 3: before, the message listed every SAN (tens of KB) and the client saw
    RESOURCE_EXHAUSTED, a retried code, instead of the CA's INVALID_ARGUMENT."""
    csr = b.many_dns_sans(600)
    details = refused(
        hostile_ca,
        lambda: hostile_ca.call(csr, token=hostile_ca.issuer.token("default", "sleep")),
        INVALID,
        "remove the other SANs",
        reason="csr-extra-sans",
    )
    assert "600 DNS SAN(s)" in details
    assert "and 597 more" in details


def test_refusal_for_a_very_long_uri_is_short_and_names_the_caller(hostile_ca: InProcessCa) -> None:
    csr = b.long_uri_san(40_000)
    details = refused(
        hostile_ca,
        lambda: hostile_ca.call(csr, token=hostile_ca.issuer.token("default", "sleep")),
        DENIED,
        "spiffe://cluster.local/ns/default/sa/sleep; a workload can only request its own",
        reason="csr-identity-mismatch",
    )
    assert "more characters" in details
