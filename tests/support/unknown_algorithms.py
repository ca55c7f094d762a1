"""Certificates and keys that parse but name a key algorithm cryptography does not know.

cryptography raises `UnsupportedAlgorithm` for them, which is no `ValueError`: the code that
reads certificates and keys from outside must still refuse them with its own error. Made by
rewriting the ecPublicKey OID (1.2.840.10045.2.1) in the DER to 0.0.840.10045.2.1; a
certificate's signature no longer matters (nothing gets that far).
"""

from __future__ import annotations

import base64

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs import PrivateKey

EC_PUBLIC_KEY_OID = bytes.fromhex("06072a8648ce3d0201")  # 1.2.840.10045.2.1
UNKNOWN_KEY_OID = bytes.fromhex("0607008648ce3d0201")  # 0.0.840.10045.2.1


def _rewritten(der: bytes) -> bytes:
    assert der.count(EC_PUBLIC_KEY_OID) == 1, "expected one ECDSA public key in the DER"
    return der.replace(EC_PUBLIC_KEY_OID, UNKNOWN_KEY_OID)


def _pem(label: str, der: bytes) -> str:
    return f"-----BEGIN {label}-----\n{base64.encodebytes(der).decode()}-----END {label}-----\n"


def certificate_pem(cert: x509.Certificate) -> str:
    """`cert` (an ECDSA one) with its public key's algorithm unknown, as PEM."""
    return _pem("CERTIFICATE", _rewritten(cert.public_bytes(serialization.Encoding.DER)))


def certificate(cert: x509.Certificate) -> x509.Certificate:
    return x509.load_pem_x509_certificate(certificate_pem(cert).encode())


def private_key_pem(key: PrivateKey) -> str:
    """`key` (an ECDSA one) as PKCS#8 PEM naming an unknown algorithm."""
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return _pem("PRIVATE KEY", _rewritten(der))
