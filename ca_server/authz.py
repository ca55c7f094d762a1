"""May this CSR be signed for this caller? meshca verifies and rejects, like istio-csr.

Istio ignores a CSR's names and writes the caller's identity; meshca instead requires the CSR to
ask for exactly that identity and nothing else, so a confused or hostile client learns at once
what it did wrong instead of receiving a certificate different from what it asked for.
"""

from __future__ import annotations

from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from ca_server.errors import InvalidRequestError, PermissionDeniedError, clip, clip_list
from certs import SpiffeId, describe_csr, key_family
from certs.csr import unexpected_extensions

_MIN_RSA_BITS = 2048
_ACCEPTED_CURVES = ("secp256r1", "secp384r1")


def authorize_csr(csr: x509.CertificateSigningRequest, identity: SpiffeId) -> None:
    """Raises unless the CSR asks for exactly `identity` as its one URI SAN, and nothing more."""
    contents = describe_csr(csr)
    extras = [
        f"{len(values)} {kind} SAN(s) {clip_list(values)}"
        for kind, values in (
            ("DNS", contents.dns_sans),
            ("IP", contents.ip_sans),
            ("email", contents.email_sans),
        )
        if values
    ]
    if contents.other_san_count:
        extras.append(f"{contents.other_san_count} other-name SAN(s)")
    if extras:
        raise InvalidRequestError(
            "csr-extra-sans",
            f"CSR asks for {', '.join(extras)}; workload certificates carry only the SPIFFE URI "
            f"{identity.uri}: remove the other SANs",
        )
    if contents.asks_for_ca:
        raise InvalidRequestError(
            "csr-asks-ca", "CSR asks for CA:true; workloads cannot be issued CA certificates"
        )
    if _asks_to_sign_certificates(csr):
        raise InvalidRequestError(
            "csr-asks-ca",
            "CSR asks for key usage keyCertSign or cRLSign; workload certificates cannot sign "
            "certificates: drop those usages",
        )
    unexpected = unexpected_extensions(csr)
    if unexpected:
        raise InvalidRequestError(
            "csr-extensions",
            f"CSR carries extensions {clip_list(unexpected)}; only subjectAltName, keyUsage and "
            "extendedKeyUsage are accepted",
        )
    if not contents.uri_sans:
        raise InvalidRequestError(
            "csr-no-identity", f"CSR has no URI SAN; it must ask for {identity.uri}"
        )
    if len(contents.uri_sans) > 1:
        raise InvalidRequestError(
            "csr-multiple-identities",
            f"CSR asks for {len(contents.uri_sans)} URI SANs {clip_list(contents.uri_sans)}; "
            f"ask for exactly one: {identity.uri}",
        )
    if contents.uri_sans[0] != identity.uri:
        raise PermissionDeniedError(
            "csr-identity-mismatch",
            f"CSR asks for {clip(contents.uri_sans[0])} but the caller is authenticated as "
            f"{identity.uri}; a workload can only request its own identity",
        )
    _check_public_key(csr)


def _asks_to_sign_certificates(csr: x509.CertificateSigningRequest) -> bool:
    """The issued profile never grants these, but a CSR asking for them is refused (like
    CA:true) rather than silently answered with less than it asked for."""
    try:
        usage = csr.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return usage.key_cert_sign or usage.crl_sign


def _check_public_key(csr: x509.CertificateSigningRequest) -> None:
    key = csr.public_key()
    family = key_family(key)  # not isinstance: ABC checks cost on every request
    if family == "rsa":
        key_size = cast(rsa.RSAPublicKey, key).key_size
        if key_size < _MIN_RSA_BITS:
            raise InvalidRequestError(
                "csr-weak-key", f"CSR key is RSA-{key_size}; use RSA-2048 or larger, or ECDSA"
            )
        return
    if family == "ec":
        curve = cast(ec.EllipticCurvePublicKey, key).curve
        if curve.name not in _ACCEPTED_CURVES:
            raise InvalidRequestError(
                "csr-key-type", f"CSR key uses curve {curve.name}; use P-256 or P-384"
            )
        return
    raise InvalidRequestError(
        "csr-key-type", f"CSR key type {type(key).__name__} is not supported; use ECDSA or RSA"
    )
