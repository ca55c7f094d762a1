"""Keys in unusual shapes, over the wire: the CA's leaf (signed from its DER template, which may
slice the key from the CSR) carries the key canonically encoded, exactly as the reference
builder would, or the request is refused as before (unsupported types: test_csr_surface)."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from certs import build_csr, load_cert
from tests.support.hostile_csr import compressed_point
from tests.support.inprocess_ca import SLEEP, InProcessCa


def _issue(ca: InProcessCa, csr: str) -> x509.Certificate:
    issued_before = ca.issued_count()
    chain = ca.call(csr, token=ca.issuer.token("default", "sleep"))
    assert ca.issued_count() == issued_before + 1
    leaf = load_cert(chain[0])
    leaf.verify_directly_issued_by(ca.authority.cert)
    return leaf


def _same_as_the_builder(ca: InProcessCa, leaf: x509.Certificate) -> None:
    """The reference builder, given the leaf's serial and validity, signs the same TBS."""
    key = leaf.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey)
    reference = ca.authority.leaf_profile.build(
        key,
        SLEEP,
        not_before=leaf.not_valid_before_utc,
        not_after=leaf.not_valid_after_utc,
        serial=leaf.serial_number,
    )
    assert leaf.tbs_certificate_bytes == reference.tbs_certificate_bytes


def test_a_compressed_ec_point_is_issued_uncompressed(hostile_ca: InProcessCa) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = _issue(hostile_ca, compressed_point(key, SLEEP))
    spki = leaf.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert spki == key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert spki in leaf.tbs_certificate_bytes  # the uncompressed form, 04 || X || Y
    assert spki[26] == 0x04
    _same_as_the_builder(hostile_ca, leaf)


def test_an_rsa_key_with_exponent_3_is_certified_as_it_is(hostile_ca: InProcessCa) -> None:
    key = rsa.generate_private_key(public_exponent=3, key_size=2048)
    leaf = _issue(hostile_ca, build_csr(key, SLEEP))
    certified = leaf.public_key()
    assert isinstance(certified, rsa.RSAPublicKey)
    assert certified.public_numbers() == key.public_key().public_numbers()
    _same_as_the_builder(hostile_ca, leaf)


def test_a_p384_key_slice_is_the_canonical_encoding(hostile_ca: InProcessCa) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    leaf = _issue(hostile_ca, build_csr(key, SLEEP))
    _same_as_the_builder(hostile_ca, leaf)
