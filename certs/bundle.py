"""The canonical digest of a trust bundle: what an agent reports it holds and what the CA compares
against the bundles it has published, so both sides must compute it the same way — here, once.

SHA-256 over the sorted, de-duplicated SHA-256 digests of the roots' DER: independent of the
order and repetition of the PEM blocks a bundle file happens to hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding


def root_fingerprint(cert: x509.Certificate) -> bytes:
    """SHA-256 of the certificate's DER."""
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).digest()


def bundle_digest(roots: Iterable[x509.Certificate]) -> str:
    """Hex SHA-256 over the sorted fingerprints of `roots` (duplicates counted once)."""
    digest = hashlib.sha256()
    for fingerprint in sorted({root_fingerprint(root) for root in roots}):
        digest.update(fingerprint)
    return digest.hexdigest()
