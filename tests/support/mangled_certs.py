"""Certificates and keys that load but break later: what cryptography parses lazily.

cryptography parses a certificate's public key, names and extensions on first use, and what it
raises then is not always a `ValueError` (`UnsupportedAlgorithm` for a key or curve it does not
know, `DuplicateExtension`). Code that reads certificates and keys from outside must still
refuse them with its own error; these make such inputs by rewriting bytes in the DER (the
signature no longer matters: nothing gets that far):

- `unknown_key_algorithm_pem(cert)` / `unknown_key_algorithm(cert)` / `private_key_pem(key)`:
  the ecPublicKey OID (1.2.840.10045.2.1) becomes 0.0.840.10045.2.1;
- `malformed_san_pem(cert)`: the subjectAltName's SEQUENCE tag becomes 0 (a parse error on the
  first read of the extensions).
"""

from __future__ import annotations

import base64

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs import PrivateKey

EC_PUBLIC_KEY_OID = bytes.fromhex("06072a8648ce3d0201")  # 1.2.840.10045.2.1
UNKNOWN_KEY_OID = bytes.fromhex("0607008648ce3d0201")  # 0.0.840.10045.2.1
SAN_OID = bytes.fromhex("0603551d11")  # 2.5.29.17


def _pem(label: str, der: bytes) -> str:
    return f"-----BEGIN {label}-----\n{base64.encodebytes(der).decode()}-----END {label}-----\n"


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def _replace_once(der: bytes, old: bytes, new: bytes) -> bytes:
    assert der.count(old) == 1, f"expected {old.hex()} once in the DER"
    return der.replace(old, new)


def unknown_key_algorithm_pem(cert: x509.Certificate) -> str:
    """`cert` (an ECDSA one) with its public key's algorithm unknown, as PEM."""
    return _pem("CERTIFICATE", _replace_once(_der(cert), EC_PUBLIC_KEY_OID, UNKNOWN_KEY_OID))


def unknown_key_algorithm(cert: x509.Certificate) -> x509.Certificate:
    return x509.load_pem_x509_certificate(unknown_key_algorithm_pem(cert).encode())


def private_key_pem(key: PrivateKey) -> str:
    """`key` (an ECDSA one) as PKCS#8 PEM naming an unknown algorithm."""
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return _pem("PRIVATE KEY", _replace_once(der, EC_PUBLIC_KEY_OID, UNKNOWN_KEY_OID))


def malformed_san_pem(cert: x509.Certificate) -> str:
    """`cert` (with a subjectAltName, not critical or critical) whose SAN does not parse."""
    der = bytearray(_der(cert))
    at = bytes(der).index(SAN_OID) + len(SAN_OID)
    if der[at] == 0x01:  # BOOLEAN critical
        at += 3
    assert der[at] == 0x04 and der[at + 2] == 0x30, "OCTET STRING holding a SEQUENCE"
    der[at + 2] = 0x00
    return _pem("CERTIFICATE", bytes(der))
