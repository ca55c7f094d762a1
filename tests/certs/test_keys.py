from __future__ import annotations

from datetime import timedelta

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from certs import (
    KeyMaterialError,
    KeySpec,
    build_root_certificate,
    generate_private_key,
    key_matches_certificate,
    load_private_key,
    private_key_to_pem,
    public_key_of,
)
from certs.keys import describe_key, public_key_bytes, signature_hash_for
from tests.support import mangled_certs
from tests.support.pki_views import NOW, Pki, make_leaf


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ec-p256", KeySpec("ECDSA", curve="P256")),
        ("EC-P384", KeySpec("ECDSA", curve="P384")),
        ("ecdsa-p256", KeySpec("ECDSA", curve="P256")),
        ("ec", KeySpec("ECDSA", curve="P256")),
        ("rsa-2048", KeySpec("RSA", rsa_bits=2048)),
        ("rsa-3072", KeySpec("RSA", rsa_bits=3072)),
        (" RSA-4096 ", KeySpec("RSA", rsa_bits=4096)),
        ("rsa", KeySpec("RSA", rsa_bits=2048)),
    ],
)
def test_keyspec_parse_accepts_supported_kinds(text: str, expected: KeySpec) -> None:
    spec = KeySpec.parse(text)
    assert spec == expected
    assert KeySpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "text", ["ec-p521", "ec-p224", "rsa-1024", "rsa-8192", "rsa-big", "ed25519", "dsa-2048", ""]
)
def test_keyspec_parse_refuses_unsupported_kinds(text: str) -> None:
    with pytest.raises(KeyMaterialError):
        KeySpec.parse(text)


def test_keyspec_constructor_refuses_unsupported_values() -> None:
    with pytest.raises(KeyMaterialError, match="curve"):
        KeySpec("ECDSA", curve="P521")
    with pytest.raises(KeyMaterialError, match="RSA key size"):
        KeySpec("RSA", rsa_bits=1024)
    with pytest.raises(KeyMaterialError, match="algorithm"):
        KeySpec("Ed25519")  # type: ignore[arg-type]


def test_keyspec_default_is_p256() -> None:
    assert KeySpec() == KeySpec("ECDSA", curve="P256")
    assert str(KeySpec()) == "ec-p256"


@pytest.mark.parametrize(
    ("spec", "key_type", "size", "name"),
    [
        (KeySpec("ECDSA", curve="P256"), ec.EllipticCurvePrivateKey, 256, "ec-secp256r1"),
        (KeySpec("ECDSA", curve="P384"), ec.EllipticCurvePrivateKey, 384, "ec-secp384r1"),
        (KeySpec("RSA", rsa_bits=2048), rsa.RSAPrivateKey, 2048, "rsa-2048"),
    ],
)
def test_generate_private_key_makes_the_requested_kind(
    spec: KeySpec, key_type: type, size: int, name: str
) -> None:
    key = generate_private_key(spec)
    assert isinstance(key, key_type)
    assert key.key_size == size
    assert describe_key(key) == name
    assert describe_key(key.public_key()) == name
    # PEM round-trip preserves the key.
    pem = private_key_to_pem(key)
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
    reloaded = load_private_key(pem)
    assert public_key_bytes(reloaded) == public_key_bytes(key)
    assert load_private_key(pem.decode()).key_size == size


def test_generate_private_key_defaults_to_p256() -> None:
    key = generate_private_key()
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)


def test_rsa_public_exponent_is_65537() -> None:
    key = generate_private_key(KeySpec("RSA", rsa_bits=2048))
    assert isinstance(key, rsa.RSAPrivateKey)
    assert key.public_key().public_numbers().e == 65537


def test_load_private_key_accepts_sec1_and_pkcs1(pki: Pki) -> None:
    sec1 = pki.leaf_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    assert sec1.startswith(b"-----BEGIN EC PRIVATE KEY-----")
    assert public_key_bytes(load_private_key(sec1)) == public_key_bytes(pki.leaf_key)


def test_load_private_key_refuses_ed25519() -> None:
    pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(KeyMaterialError, match="Ed25519"):
        load_private_key(pem)


def test_load_private_key_refuses_encrypted_and_garbage(pki: Pki) -> None:
    encrypted = pki.leaf_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    for data in (encrypted, b"not a key", b"", "-----BEGIN PRIVATE KEY-----\nAAAA\n"):
        with pytest.raises(KeyMaterialError, match="unencrypted PEM private key"):
            load_private_key(data)


def test_an_unknown_key_algorithm_is_key_material_error(pki: Pki) -> None:
    """cryptography's UnsupportedAlgorithm is no ValueError: it must still come out as
    KeyMaterialError, so a mounted key file or a kubelet bundle holding such a key or leaf is
    refused and counted, not a crashed reload."""
    with pytest.raises(KeyMaterialError, match="unencrypted PEM private key"):
        load_private_key(mangled_certs.private_key_pem(pki.leaf_key))
    strange_leaf = mangled_certs.unknown_key_algorithm(make_leaf(pki))
    with pytest.raises(KeyMaterialError, match="unsupported or malformed public key"):
        public_key_of(strange_leaf)
    with pytest.raises(KeyMaterialError):
        key_matches_certificate(pki.leaf_key, strange_leaf)


def test_key_matches_certificate(pki: Pki, other_pki: Pki) -> None:
    assert key_matches_certificate(pki.root_key, pki.root)
    assert key_matches_certificate(pki.intermediate_key, pki.intermediate)
    assert not key_matches_certificate(other_pki.root_key, pki.root)
    assert not key_matches_certificate(pki.intermediate_key, pki.root)


def test_public_key_of_refuses_ed25519_certificate() -> None:
    from cryptography import x509

    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(NOW)
        .not_valid_after(NOW + timedelta(days=1))
        .sign(key, None)
    )
    with pytest.raises(KeyMaterialError, match="Ed25519"):
        public_key_of(cert)


def test_public_key_of_certificate(pki: Pki) -> None:
    assert public_key_bytes(public_key_of(pki.root)) == public_key_bytes(pki.root_key)


def test_signature_hash_matches_key_strength() -> None:
    assert isinstance(signature_hash_for(generate_private_key()), hashes.SHA256)
    p384 = generate_private_key(KeySpec("ECDSA", curve="P384"))
    assert isinstance(signature_hash_for(p384), hashes.SHA384)
    root = build_root_certificate(p384, "example.org", now=NOW, lifetime=timedelta(days=1))
    assert isinstance(root.signature_hash_algorithm, hashes.SHA384)
