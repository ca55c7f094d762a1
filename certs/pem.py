"""PEM encoding and decoding of certificates and bundles, and the concatenated-DER form the
SPIFFE Workload API carries chains and bundles in."""

from __future__ import annotations

import binascii
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs.errors import PemError


def cert_to_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def der_to_pem(der: bytes) -> str:
    """The PEM block of a DER certificate: the text `cert_to_pem` gives for it (64 base64
    characters a line), without parsing the certificate (the CA's signer holds the leaf as DER)."""
    text = binascii.b2a_base64(der, newline=False)
    lines = b"\n".join([text[i : i + 64] for i in range(0, len(text), 64)])
    return (b"-----BEGIN CERTIFICATE-----\n" + lines + b"\n-----END CERTIFICATE-----\n").decode(
        "ascii"
    )


def certs_to_pem(certs: Iterable[x509.Certificate]) -> str:
    """Concatenated PEM blocks, each ending with a newline (a bundle file's content)."""
    return "".join(cert_to_pem(cert) for cert in certs)


# What cryptography raises for a certificate it cannot parse, now or (extensions) on first use:
# InvalidVersion and DuplicateExtension are not ValueErrors.
_MALFORMED = (ValueError, x509.InvalidVersion, x509.DuplicateExtension)


def _parsed_through(cert: x509.Certificate) -> x509.Certificate:
    """`cert` with its extensions parsed now: cryptography parses them lazily, on first use, so
    a malformed one would otherwise surface as a ValueError (or DuplicateExtension) far from
    here, in whatever first reads the SANs or BasicConstraints. They are cached once parsed, so
    this moves the cost rather than adding it. (Names are checked where they are turned into
    text, `certs.inspect.describe_certificate`; the public key where it is used,
    `certs.keys.public_key_of`.)"""
    _ = cert.extensions
    return cert


def load_certs(data: bytes | str, *, what: str = "certificate") -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, in order; at least one, or `PemError` naming `what`.
    Extensions are parsed too (`_parsed_through`): a certificate returned is whole."""
    raw = data.encode() if isinstance(data, str) else data
    if b"-----BEGIN CERTIFICATE-----" not in raw:
        raise PemError(f"{what}: no PEM CERTIFICATE block found")
    try:
        return [_parsed_through(cert) for cert in x509.load_pem_x509_certificates(raw)]
    except _MALFORMED as exc:
        raise PemError(f"{what}: malformed PEM certificate ({exc})") from exc


def load_cert(data: bytes | str, *, what: str = "certificate") -> x509.Certificate:
    """The first certificate of a PEM bundle."""
    return load_certs(data, what=what)[0]


def certs_to_der(certs: Iterable[x509.Certificate]) -> bytes:
    """Concatenated DER certificates (a Workload API chain or bundle)."""
    return b"".join(cert.public_bytes(serialization.Encoding.DER) for cert in certs)


def load_der_certs(data: bytes, *, what: str = "certificate") -> list[x509.Certificate]:
    """The certificates of a concatenated-DER blob, in order; at least one, or `PemError`
    naming `what`. Each is split off by its outer SEQUENCE's length, then parsed."""
    certs = []
    offset = 0
    while offset < len(data):
        end = _der_end(data, offset, what)
        try:
            certs.append(_parsed_through(x509.load_der_x509_certificate(data[offset:end])))
        except _MALFORMED as exc:
            raise PemError(f"{what}: malformed DER certificate #{len(certs) + 1} ({exc})") from exc
        offset = end
    if not certs:
        raise PemError(f"{what}: no DER certificate found")
    return certs


def _der_end(data: bytes, offset: int, what: str) -> int:
    """Where the DER SEQUENCE starting at `offset` ends (definite lengths only, as DER is)."""
    if len(data) - offset < 2 or data[offset] != 0x30:
        raise PemError(f"{what}: not a DER certificate at byte {offset}")
    first = data[offset + 1]
    if first < 0x80:
        header, length = 2, first
    else:
        count = first & 0x7F
        if count == 0 or count > 4 or len(data) - offset < 2 + count:
            raise PemError(f"{what}: bad DER length at byte {offset}")
        header = 2 + count
        length = int.from_bytes(data[offset + 2 : offset + header], "big")
    end = offset + header + length
    if end > len(data):
        raise PemError(f"{what}: DER certificate at byte {offset} is cut short")
    return end
