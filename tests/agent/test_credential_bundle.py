"""The kubelet's `podCertificate` credential bundle parser (`agent.credential_bundle`): what the
kubelet writes is read back exactly; everything it never writes is refused, saying what, without
key material. Pure and fast: bytes in, no files."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from agent.credential_bundle import (
    MAX_CREDENTIAL_BUNDLE_BYTES,
    CredentialBundle,
    parse_credential_bundle,
)
from agent.errors import FileSecretError
from certs import PrivateKey, generate_private_key, key_matches_certificate
from tests.support.pki import Issued, TestCa

NOW = datetime.now(UTC)


@pytest.fixture(scope="module")
def ca() -> TestCa:
    return TestCa(NOW)


@pytest.fixture(scope="module")
def issued(ca: TestCa) -> Issued:
    return ca.issue("app")


def parse(text: str | bytes) -> CredentialBundle:
    data = text.encode() if isinstance(text, str) else text
    return parse_credential_bundle(data, source="/pod/credential-bundle.pem")


def refusal(text: str | bytes) -> str:
    with pytest.raises(FileSecretError) as info:
        parse(text)
    message = str(info.value)
    assert "/pod/credential-bundle.pem" in message, "the message names the file"
    assert "MII" not in message and "-----BEGIN" not in message, "no PEM text in messages"
    return message


def pem_key(
    key: PrivateKey | ed25519.Ed25519PrivateKey,
    form: serialization.PrivateFormat,
    password: bytes | None = None,
) -> str:
    encryption: serialization.KeySerializationEncryption = serialization.NoEncryption()
    if password:
        encryption = serialization.BestAvailableEncryption(password)
    return key.private_bytes(serialization.Encoding.PEM, form, encryption).decode()


def test_the_kubelets_layout_is_read_back_exactly(issued: Issued) -> None:
    bundle = parse(issued.credential_bundle)
    assert bundle.key_pem == issued.key_pem
    assert bundle.chain_pem == issued.cert_pem
    assert bundle.leaf.serial_number == issued.serial
    assert key_matches_certificate(bundle.key, bundle.leaf)
    assert "PRIVATE" not in repr(bundle), "the key stays out of repr"


def test_a_chain_with_intermediates_keeps_its_order(ca: TestCa) -> None:
    inner = ca.child_ca().child_ca()
    issued = inner.issue("app")
    bundle = parse(issued.credential_bundle)
    assert [cert.serial_number for cert in bundle.chain] == [
        issued.serial,
        inner.cert.serial_number,
        inner.parent.cert.serial_number,  # type: ignore[union-attr]
    ]


def test_whitespace_and_crlf_between_blocks_are_fine(issued: Issued) -> None:
    text = "\n" + issued.key_pem.replace("\n", "\r\n") + "\n\n" + issued.cert_pem + "\n"
    assert parse(text).leaf.serial_number == issued.serial


def test_a_key_that_is_not_pkcs8_is_refused(issued: Issued) -> None:
    sec1 = pem_key(generate_private_key(), serialization.PrivateFormat.TraditionalOpenSSL)
    assert "EC PRIVATE KEY" in refusal(sec1 + issued.cert_pem)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pkcs1 = pem_key(rsa_key, serialization.PrivateFormat.TraditionalOpenSSL)
    assert "RSA PRIVATE KEY" in refusal(pkcs1 + issued.cert_pem)
    encrypted = pem_key(generate_private_key(), serialization.PrivateFormat.PKCS8, b"secret")
    assert "ENCRYPTED PRIVATE KEY" in refusal(encrypted + issued.cert_pem)


def test_blocks_in_the_wrong_order_are_refused(issued: Issued) -> None:
    message = refusal(issued.cert_pem + issued.key_pem)
    assert "wrong order" in message and "block 2" in message


def test_two_keys_are_refused(issued: Issued, ca: TestCa) -> None:
    other = ca.issue("app")
    assert "2 private keys" in refusal(issued.key_pem + other.key_pem + issued.cert_pem)
    assert "2 private keys" in refusal(issued.credential_bundle + other.key_pem)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("key only", "no certificate chain"),
        ("chain only", "no private key"),
        ("empty", "no PEM blocks"),
        ("public key after", "'PUBLIC KEY' block"),
        ("stray text", "stray text"),
        ("unterminated", "unterminated"),
        ("mismatched end", "does not end as it began"),
        ("non-ascii", "non-ASCII"),
        ("oversized", "over the limit"),
        ("garbled key", "does not parse as PKCS#8"),
        ("garbled certificate", "malformed PEM certificate"),
    ],
)
def test_malformed_bundles_are_refused(issued: Issued, case: str, expected: str) -> None:
    key, chain = issued.key_pem, issued.cert_pem
    public = (
        generate_private_key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    body = key.splitlines()[1]
    text = {
        "key only": key,
        "chain only": chain,
        "empty": "\n\n",
        "public key after": key + chain + public,
        "stray text": key + "issued by our CA\n" + chain,
        "unterminated": key + chain + "-----BEGIN CERTIFICATE-----\nMIIB\n",
        "mismatched end": key.replace("END PRIVATE KEY", "END EC PRIVATE KEY") + chain,
        "non-ascii": "# émis\n" + key + chain,
        "oversized": key + chain * (MAX_CREDENTIAL_BUNDLE_BYTES // len(chain) + 1),
        "garbled key": key.replace(body, "A" * len(body)) + chain,
        "garbled certificate": key + chain.replace(chain.splitlines()[2], "A" * 64),
    }[case]
    message = refusal(text)
    assert expected in message
    assert body not in message


def test_an_ed25519_key_is_refused_naming_a_key_type_envoy_serves(issued: Issued) -> None:
    key = pem_key(ed25519.Ed25519PrivateKey.generate(), serialization.PrivateFormat.PKCS8)
    message = refusal(key + issued.cert_pem)
    assert "Ed25519" in message and "keyType" in message and "ECDSAP256" in message
