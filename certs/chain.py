"""Chain verification: does a leaf (plus intermediates) lead to one of the trusted roots?

A small path check of our own rather than a web-PKI verifier: SPIFFE leaves have an empty
subject and URI-only SANs, which browser-oriented policies reject by design.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from certs.errors import ChainError


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """True when `issuer`'s key signed `cert` and the names link up."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _check_time(cert: x509.Certificate, now: datetime, what: str) -> None:
    if now < cert.not_valid_before_utc:
        raise ChainError(f"{what} is not valid until {cert.not_valid_before_utc.isoformat()}")
    if now > cert.not_valid_after_utc:
        raise ChainError(f"{what} expired at {cert.not_valid_after_utc.isoformat()}")


def verify_chain(
    chain: Sequence[x509.Certificate],
    roots: Sequence[x509.Certificate],
    *,
    now: datetime,
) -> x509.Certificate:
    """Checks `chain` (leaf first, then intermediates in order) against `roots` at `now`.

    Every link must be signed by the next, every issuer must be a CA, every certificate valid at
    `now`. Returns the root the chain ends at; raises `ChainError` saying which link failed.
    """
    if not chain:
        raise ChainError("empty certificate chain")
    if not roots:
        raise ChainError("no trusted roots to verify against")
    for index, cert in enumerate(chain):
        what = "leaf certificate" if index == 0 else f"intermediate #{index}"
        _check_time(cert, now, what)
        if index + 1 < len(chain):
            issuer = chain[index + 1]
            if not is_ca(issuer):
                raise ChainError(f"intermediate #{index + 1} is not a CA certificate")
            if not issued_by(cert, issuer):
                raise ChainError(f"{what} was not signed by the next certificate in the chain")
    last = chain[-1]
    for root in roots:
        if last == root or issued_by(last, root):
            if not is_ca(root):
                raise ChainError("the matching root is not a CA certificate")
            _check_time(root, now, "root certificate")
            return root
    raise ChainError("the chain does not lead to any trusted root")
