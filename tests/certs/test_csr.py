from __future__ import annotations

import base64
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID

from certs import (
    MAX_CSR_BYTES,
    CsrError,
    KeySpec,
    PrivateKey,
    SpiffeId,
    build_csr,
    describe_csr,
    generate_private_key,
    load_csr,
    load_verified_csr,
)
from certs.csr import _signature_verifies, unexpected_extensions
from certs.keys import public_key_bytes
from tests.support.hostile_csr import csr_with, pem_of, two_sans
from tests.support.pki_views import IDENTITY

_HEADER = "-----BEGIN CERTIFICATE REQUEST-----"
_FOOTER = "-----END CERTIFICATE REQUEST-----"


@pytest.fixture(scope="module")
def key() -> PrivateKey:
    return generate_private_key()


@pytest.mark.parametrize(
    "spec", [KeySpec("ECDSA", curve="P256"), KeySpec("ECDSA", curve="P384"), KeySpec("RSA")]
)
def test_build_then_load_round_trip(spec: KeySpec) -> None:
    key = generate_private_key(spec)
    pem = build_csr(key, IDENTITY)
    assert pem.startswith(_HEADER)
    csr = load_csr(pem)
    assert csr.subject == x509.Name([])
    assert public_key_bytes(csr.public_key()) == public_key_bytes(key)  # type: ignore[arg-type]
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical  # the subject is empty
    assert list(san.value) == [x509.UniformResourceIdentifier(IDENTITY.uri)]
    assert len(csr.extensions) == 1
    contents = describe_csr(csr)
    assert contents.uri_sans == (IDENTITY.uri,)
    assert contents.dns_sans == contents.ip_sans == contents.email_sans == ()
    assert contents.other_san_count == 0
    assert not contents.asks_for_ca
    assert contents.subject == ""
    assert unexpected_extensions(csr) == []


def test_load_accepts_bytes(key: PrivateKey) -> None:
    pem = build_csr(key, SpiffeId("example.org", "ns1", "sa1"))
    csr = load_csr(pem.encode())
    assert describe_csr(csr).uri_sans == ("spiffe://example.org/ns/ns1/sa/sa1",)


def test_load_rejects_oversized_csr(key: PrivateKey) -> None:
    pem = build_csr(key, IDENTITY)
    padded = pem + " " * (MAX_CSR_BYTES + 1 - len(pem))
    assert len(padded) == MAX_CSR_BYTES + 1
    with pytest.raises(CsrError, match="limit is 65536 bytes"):
        load_csr(padded)
    # One byte under the limit still loads: the check is on size, not on padding.
    assert load_csr(padded[:-1]) is not None


def test_load_honours_custom_limit(key: PrivateKey) -> None:
    pem = build_csr(key, IDENTITY).encode()
    assert load_csr(pem, max_bytes=len(pem)) is not None
    with pytest.raises(CsrError, match="limit"):
        load_csr(pem, max_bytes=len(pem) - 1)


def test_max_csr_bytes_is_64_kib() -> None:
    assert MAX_CSR_BYTES == 64 * 1024


def test_load_rejects_non_pem(key: PrivateKey) -> None:
    csr = x509.load_pem_x509_csr(build_csr(key, IDENTITY).encode())
    der = csr.public_bytes(Encoding.DER)
    for data in (der, b"", "hello", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----"):
        with pytest.raises(CsrError, match="not PEM"):
            load_csr(data)


@pytest.mark.parametrize(
    "body",
    ["Zm9vYmFy", "!!!not base64!!!", "", base64.b64encode(b"\x30\x03\x02\x01\x01").decode()],
)
def test_load_rejects_garbage_inside_the_pem_block(body: str) -> None:
    with pytest.raises(CsrError, match="does not parse"):
        load_csr(f"{_HEADER}\n{body}\n{_FOOTER}\n")


@pytest.mark.parametrize("spec", [KeySpec("ECDSA", curve="P256"), KeySpec("RSA")])
def test_load_rejects_csr_whose_signature_does_not_verify(spec: KeySpec) -> None:
    key = generate_private_key(spec)
    csr = x509.load_pem_x509_csr(build_csr(key, IDENTITY).encode())
    der = bytearray(csr.public_bytes(Encoding.DER))
    # The signature BIT STRING is the last field; its final byte is signature value, not framing.
    assert der.endswith(csr.signature)
    der[-1] ^= 0x01
    tampered = pem_of(bytes(der))
    # Still a well-formed CSR: only the signature check can catch it.
    assert x509.load_pem_x509_csr(tampered.encode()).subject == x509.Name([])
    with pytest.raises(CsrError, match="signature does not verify"):
        load_csr(tampered)


def test_load_rejects_csr_with_tampered_request_info(key: PrivateKey) -> None:
    """Changing what is asked for (not the signature) must also break verification."""
    pem = build_csr(key, SpiffeId("cluster.local", "default", "aaaa"))
    der = x509.load_pem_x509_csr(pem.encode()).public_bytes(Encoding.DER)
    forged = der.replace(b"/sa/aaaa", b"/sa/root")
    assert forged != der
    with pytest.raises(CsrError, match="signature does not verify"):
        load_csr(pem_of(forged))


def test_load_rejects_csr_with_a_duplicated_extension() -> None:
    with pytest.raises(CsrError, match=r"extensions do not parse.*Duplicate"):
        load_csr(two_sans(IDENTITY))


def test_load_rejects_csr_with_a_malformed_extension(key: PrivateKey) -> None:
    broken_san = x509.UnrecognizedExtension(ExtensionOID.SUBJECT_ALTERNATIVE_NAME, b"\x30\x03\x01")
    with pytest.raises(CsrError, match="extensions do not parse"):
        load_csr(csr_with(key=key, extensions=[(broken_san, True)]))


def test_describe_splits_sans_by_kind(key: PrivateKey) -> None:
    san = x509.SubjectAlternativeName(
        [
            x509.UniformResourceIdentifier("spiffe://cluster.local/ns/a/sa/b"),
            x509.UniformResourceIdentifier("https://example.com"),
            x509.DNSName("example.com"),
            x509.DNSName("*.mesh.svc"),
            x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("2001:db8::1")),
            x509.RFC822Name("ops@example.com"),
            x509.RegisteredID(x509.ObjectIdentifier("1.2.3.4")),
            x509.DirectoryName(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])),
        ]
    )
    contents = describe_csr(load_csr(csr_with(key=key, extensions=[(san, False)])))
    assert contents.uri_sans == ("spiffe://cluster.local/ns/a/sa/b", "https://example.com")
    assert contents.dns_sans == ("example.com", "*.mesh.svc")
    assert contents.ip_sans == ("10.0.0.1", "2001:db8::1")
    assert contents.email_sans == ("ops@example.com",)
    assert contents.other_san_count == 2
    assert not contents.asks_for_ca
    assert contents.extension_names == ("subjectAltName",)


def test_describe_reports_subject(key: PrivateKey) -> None:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "acme"),
                    x509.NameAttribute(NameOID.COMMON_NAME, "web"),
                ]
            )
        )
        .sign(key, hashes.SHA256())
    )
    contents = describe_csr(csr)
    assert contents.subject == "CN=web,O=acme"
    assert contents.uri_sans == ()
    assert contents.extension_names == ()


@pytest.mark.parametrize(("ca", "expected"), [(True, True), (False, False)])
def test_describe_detects_ca_request(key: PrivateKey, ca: bool, expected: bool) -> None:
    csr = load_csr(
        csr_with(
            key=key,
            extensions=[
                (x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY.uri)]), True),
                (x509.BasicConstraints(ca=ca, path_length=None), True),
            ],
        )
    )
    contents = describe_csr(csr)
    assert contents.asks_for_ca is expected
    assert contents.uri_sans == (IDENTITY.uri,)
    assert contents.extension_names == ("subjectAltName", "basicConstraints")


def test_unexpected_extensions_allows_san_ku_eku(key: PrivateKey) -> None:
    csr = load_csr(
        csr_with(
            key=key,
            extensions=[
                (x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY.uri)]), True),
                (
                    x509.KeyUsage(
                        digital_signature=True,
                        content_commitment=False,
                        key_encipherment=True,
                        data_encipherment=False,
                        key_agreement=False,
                        key_cert_sign=False,
                        crl_sign=False,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    True,
                ),
                (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False),
            ],
        )
    )
    assert unexpected_extensions(csr) == []


def test_unexpected_extensions_names_the_others(key: PrivateKey) -> None:
    csr = load_csr(
        csr_with(
            key=key,
            extensions=[
                (x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY.uri)]), True),
                (x509.BasicConstraints(ca=False, path_length=None), True),
                (x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False),
                (
                    x509.UnrecognizedExtension(
                        x509.ObjectIdentifier("1.3.6.1.4.1.99999.1"), b"\x05\x00"
                    ),
                    False,
                ),
            ],
        )
    )
    assert unexpected_extensions(csr) == [
        "basicConstraints",
        "subjectKeyIdentifier",
        "1.3.6.1.4.1.99999.1",
    ]
    assert describe_csr(csr).extension_names[-1] == "1.3.6.1.4.1.99999.1"
    assert ExtensionOID.BASIC_CONSTRAINTS in {e.oid for e in csr.extensions}


def _usage(*, cert_sign: bool, crl_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


@pytest.mark.parametrize(
    ("cert_sign", "crl_sign", "expected"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_describe_detects_a_request_to_sign_certificates(
    key: PrivateKey, cert_sign: bool, crl_sign: bool, expected: bool
) -> None:
    csr = load_csr(
        csr_with(
            key=key,
            extensions=[
                (x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY.uri)]), True),
                (_usage(cert_sign=cert_sign, crl_sign=crl_sign), True),
            ],
        )
    )
    contents = describe_csr(csr)
    assert contents.asks_to_sign_certificates is expected
    assert contents.asks_for_ca is False
    assert contents.unexpected_extension_names == ()


def test_describe_lists_unexpected_extensions_in_the_same_pass(key: PrivateKey) -> None:
    csr = load_csr(
        csr_with(
            key=key,
            extensions=[
                (x509.BasicConstraints(ca=False, path_length=None), True),
                (x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY.uri)]), True),
                (x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False),
            ],
        )
    )
    contents = describe_csr(csr)
    assert contents.unexpected_extension_names == ("basicConstraints", "subjectKeyIdentifier")
    assert contents.extension_names == (
        "basicConstraints",
        "subjectAltName",
        "subjectKeyIdentifier",
    )
    assert contents.uri_sans == (IDENTITY.uri,)
    assert contents.asks_to_sign_certificates is False


# --- the lean signature check decides as `is_signature_valid` --------------------------------

# Signature algorithm identifiers (DER), to re-label a CSR's signature with another algorithm.
_ALGORITHM_IDS = {
    "ecdsa-sha256": bytes.fromhex("300a06082a8648ce3d040302"),
    "ecdsa-sha384": bytes.fromhex("300a06082a8648ce3d040303"),
    "ecdsa-sha512": bytes.fromhex("300a06082a8648ce3d040304"),
    "rsa-sha256": bytes.fromhex("300d06092a864886f70d01010b0500"),
}
_SIGNERS: dict[str, tuple[KeySpec, hashes.SHA256 | hashes.SHA384 | hashes.SHA512]] = {
    # key, and the hash its CSR is signed with
    "p256-sha256": (KeySpec("ECDSA", curve="P256"), hashes.SHA256()),
    "p256-sha384": (KeySpec("ECDSA", curve="P256"), hashes.SHA384()),
    "p384-sha384": (KeySpec("ECDSA", curve="P384"), hashes.SHA384()),
    "p384-sha256": (KeySpec("ECDSA", curve="P384"), hashes.SHA256()),
    "p256-sha512": (KeySpec("ECDSA", curve="P256"), hashes.SHA512()),
    "rsa-sha256": (KeySpec("RSA"), hashes.SHA256()),
}


def _relabelled(csr: x509.CertificateSigningRequest, algorithm: bytes, flip: int | None) -> bytes:
    """`csr`'s DER with its signatureAlgorithm replaced and, with `flip`, one byte of the
    request info (`flip` >= 0) or of the signature value (`flip` < 0) changed."""
    info = bytearray(csr.tbs_certrequest_bytes)
    signature = bytearray(csr.signature)
    if flip is not None and flip >= 0:
        info[flip % len(info)] ^= 0x01
    elif flip is not None:
        signature[flip % len(signature)] ^= 0x01
    bit_string = b"\x00" + bytes(signature)
    body = bytes(info) + algorithm + b"\x03" + _length(len(bit_string)) + bit_string
    return b"\x30" + _length(len(body)) + body


def _length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


@pytest.fixture(scope="module")
def signed_csrs() -> dict[str, x509.CertificateSigningRequest]:
    csrs = {}
    for name, (spec, hash_algorithm) in _SIGNERS.items():
        signing_key = generate_private_key(spec)
        csrs[name] = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY.uri)]), True
            )
            .sign(signing_key, hash_algorithm)
        )
    return csrs


@pytest.mark.parametrize("signer", list(_SIGNERS))
@pytest.mark.parametrize("algorithm", list(_ALGORITHM_IDS))
@pytest.mark.parametrize("flip", [None, 0, 7, 40, 100, -1, -9, -30])
def test_the_direct_ecdsa_check_decides_as_is_signature_valid(
    signed_csrs: dict[str, x509.CertificateSigningRequest],
    signer: str,
    algorithm: str,
    flip: int | None,
) -> None:
    """`load_verified_csr` verifies ECDSA CSRs with the key it loaded instead of
    `is_signature_valid`, which loads it again; over every pairing of key, signing hash and
    labelled algorithm (matching, a wrong hash, another key type), intact or with a byte of the
    request info or signature changed, both give the same verdict, or both refuse to decide."""
    der = _relabelled(signed_csrs[signer], _ALGORITHM_IDS[algorithm], flip)
    try:
        csr = x509.load_der_x509_csr(der)
        expected: object = csr.is_signature_valid
    except Exception as exc:  # the flipped byte broke the structure, or an unknown algorithm
        expected = type(exc)
    if expected is ValueError or expected is x509.InvalidVersion:
        with pytest.raises(CsrError):
            load_verified_csr(pem_of(der))
        return
    try:
        actual: object = _signature_verifies(csr, csr.public_key())
    except Exception as exc:
        actual = type(exc)
    assert actual == expected
    if flip is None:  # intact: valid exactly when the label is the algorithm actually used
        matching = (
            algorithm
            == f"{'rsa' if signer.startswith('rsa') else 'ecdsa'}-" + (signer.rpartition("-")[2])
        )
        assert expected is matching


def test_load_verified_csr_hands_over_the_key_it_verified_with() -> None:
    key = generate_private_key()
    verified = load_verified_csr(build_csr(key, IDENTITY))
    assert public_key_bytes(verified.public_key) == public_key_bytes(key)  # type: ignore[arg-type]
    assert verified.csr.is_signature_valid
