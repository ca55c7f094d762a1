"""PEM encoding and decoding of certificates and bundles."""

from __future__ import annotations

from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs.errors import PemError


def cert_to_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def certs_to_pem(certs: Iterable[x509.Certificate]) -> str:
    """Concatenated PEM blocks, each ending with a newline (a bundle file's content)."""
    return "".join(cert_to_pem(cert) for cert in certs)


def load_certs(data: bytes | str, *, what: str = "certificate") -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, in order; at least one, or `PemError` naming `what`."""
    raw = data.encode() if isinstance(data, str) else data
    if b"-----BEGIN CERTIFICATE-----" not in raw:
        raise PemError(f"{what}: no PEM CERTIFICATE block found")
    try:
        return x509.load_pem_x509_certificates(raw)
    except (ValueError, x509.InvalidVersion) as exc:  # InvalidVersion is not a ValueError
        raise PemError(f"{what}: malformed PEM certificate ({exc})") from exc


def load_cert(data: bytes | str, *, what: str = "certificate") -> x509.Certificate:
    """The first certificate of a PEM bundle."""
    return load_certs(data, what=what)[0]
