"""Chain verification: does a leaf (plus intermediates) lead to one of the trusted roots?

A small path check of our own rather than a web-PKI verifier: SPIFFE leaves have an empty
subject and URI-only SANs, which browser-oriented policies reject by design.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm

from certs.errors import ChainError, ChainOrderError, ForeignCertificateError


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """True when `issuer`'s key signed `cert` and the names link up."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):  # the last: an
        return False  # issuer key or curve cryptography does not know (not a ValueError)
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


# More than a leaf, a few intermediates and the roots of a rotation ever need: a longer list
# is refused before any signature is checked.
MAX_PRESENTED = 16


def _self_issued(cert: x509.Certificate) -> bool:
    """A root: its own issuer (a self-signed certificate) rather than a link to one."""
    return cert.subject == cert.issuer and issued_by(cert, cert)


def _name(cert: x509.Certificate) -> str:
    return cert.subject.rfc4514_string() or "an empty subject"


def _check_path_length(issuer: x509.Certificate, below: int, what: str) -> None:
    """`below`: how many CA certificates lie between `issuer` and the leaf."""
    constraint = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
    if constraint.path_length is not None and below > constraint.path_length:
        raise ChainError(
            f"{what} allows {constraint.path_length} intermediate(s) below it, "
            f"the chain puts {below}"
        )


def build_path(
    leaf: x509.Certificate,
    presented: Sequence[x509.Certificate],
    roots: Sequence[x509.Certificate],
    *,
    now: datetime,
) -> tuple[x509.Certificate, ...]:
    """The path from a peer's `leaf` to one of `roots`, through what it `presented` after it.

    Unlike `verify_chain`, the presented certificates are candidates rather than a strict
    sequence, because real clients send more than the path: Istio's agent appends its whole
    trust bundle (during a root overlap, two roots after the leaf), and a TLS stack hands over
    what followed the leaf. Still, everything presented must belong, so a broken
    `cert-chain.pem` is refused with what to fix rather than half-used:

    - intermediates come leaf-upward (each before the one that signed it), roots after them,
      in any order (`ChainOrderError`), and the leaf itself is no CA certificate;
    - an intermediate that is not on the path is foreign (`ForeignCertificateError`);
    - repeats of the leaf are ignored; roots the CA does not trust may ride along unused (a
      bundle written before a root was dropped), and so may a CA certificate holding the key
      of one on the path (a cross-signed twin of a root), but the path must end at a trusted
      root;
    - at most `MAX_PRESENTED` certificates after the leaf.

    Certificates are numbered as in the file the peer sent: the leaf is #1. Returns the path,
    leaf first and the trusted root last; raises `ChainError` saying which link failed.
    """
    if not roots:
        raise ChainError("no trusted roots to verify against")
    if len(presented) > MAX_PRESENTED:
        raise ChainError(
            f"{len(presented)} certificates follow the leaf, at most {MAX_PRESENTED} are "
            "accepted: send the leaf, its intermediates and the roots only"
        )
    if is_ca(leaf):
        raise ChainOrderError(
            f"certificate #1 ({_name(leaf)}) is a CA certificate, not a workload certificate: "
            "the workload's own certificate must come first, then its intermediates, then roots"
        )
    _check_time(leaf, now, "the leaf certificate (#1)")
    candidates = [(number, cert) for number, cert in enumerate(presented, 2) if cert != leaf]
    path = [leaf]
    used: set[int] = set()
    current, what = leaf, "the leaf certificate (#1)"
    while True:
        root = next((r for r in roots if current == r or issued_by(current, r)), None)
        if root is not None:
            if not is_ca(root):
                raise ChainError("the matching root is not a CA certificate")
            _check_time(root, now, "the root certificate")
            if root != current:
                _check_path_length(root, len(path) - 1, "the root certificate")
                path.append(root)
            break
        signers = [(n, c) for n, c in candidates if n not in used and issued_by(current, c)]
        if not signers:
            raise ChainError(
                f"{what} was issued by {current.issuer.rfc4514_string() or 'an empty name'}, "
                "which is neither a root this CA trusts nor any certificate presented with it"
            )
        number, issuer = signers[0]
        label = f"certificate #{number} ({_name(issuer)})"
        if not is_ca(issuer):
            raise ChainError(f"{label} signed {what} but is not a CA certificate")
        if _self_issued(issuer):
            raise ChainError(f"{what} leads to {label}, a root this CA does not trust")
        if used and number < max(used):
            raise ChainOrderError(
                f"{label} signed {what} but comes before it: list each intermediate "
                "right after the certificate it signed"
            )
        _check_time(issuer, now, label)
        _check_path_length(issuer, len(path) - 1, label)
        used.add(number)
        path.append(issuer)
        current, what = issuer, label
    last_intermediate = max(used, default=0)
    for number, cert in candidates:
        if number in used:
            continue
        label = f"certificate #{number} ({_name(cert)})"
        if not is_ca(cert):
            raise ForeignCertificateError(
                f"{label} is not a CA certificate: after the leaf come only its "
                "intermediates and roots"
            )
        if not _self_issued(cert) and not any(issued_by(link, cert) for link in path[:-1]):
            raise ForeignCertificateError(
                f"{label} is an intermediate that does not lead the leaf to a root this CA "
                "trusts (another CA's?): remove it from the chain"
            )
        if number < last_intermediate:
            raise ChainOrderError(
                f"{label} is a root but comes before intermediate #{last_intermediate}: "
                "list the intermediates first, then the roots"
            )
    return tuple(path)
