"""May this CSR be signed for this caller? meshca verifies and rejects, like istio-csr.

Istio ignores a CSR's names and writes the caller's identity; meshca instead requires the CSR to
ask for exactly that identity and nothing else, so a confused or hostile client learns at once
what it did wrong instead of receiving a certificate different from what it asked for.
"""

from __future__ import annotations

from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtensionOID

from ca_server.errors import InvalidRequestError, PermissionDeniedError, clip, clip_list
from certs import PublicKey, SpiffeId, describe_csr, key_family

_MIN_RSA_BITS = 2048
_ACCEPTED_CURVES = ("secp256r1", "secp384r1")


def authorize_csr(
    csr: x509.CertificateSigningRequest,
    identity: SpiffeId,
    *,
    public_key: CertificatePublicKeyTypes | None = None,
) -> PublicKey:
    """Raises unless the CSR asks for exactly `identity` as its one URI SAN, and nothing more.

    Returns the CSR's public key, checked (ECDSA P-256/P-384 or RSA ≥ 2048): the key to
    certify. `public_key` is the CSR's key as `certs.load_verified_csr` loaded it to verify the
    signature; without it the key is loaded from the CSR here. Read once so the signer does not
    parse it from the CSR again."""
    if _asks_for_exactly(csr, identity):
        return _checked_public_key(csr, public_key)
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
    if contents.asks_to_sign_certificates:  # the profile never grants these; refuse, like CA:true
        raise InvalidRequestError(
            "csr-asks-ca",
            "CSR asks for key usage keyCertSign or cRLSign; workload certificates cannot sign "
            "certificates: drop those usages",
        )
    unexpected = contents.unexpected_extension_names
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
    return _checked_public_key(csr, public_key)


def _asks_for_exactly(csr: x509.CertificateSigningRequest, identity: SpiffeId) -> bool:
    """The CSR an agent sends (Istio's or meshca's): one extension, a subjectAltName holding one
    URI, `identity`'s. Such a CSR passes every name and extension check below, so they are not
    spelled out one by one; anything else (other SANs or extensions, a different URI) goes
    through them and gets its own refusal. By concrete type and OID, as `describe_csr` does."""
    extensions = csr.extensions
    if len(extensions) != 1:
        return False
    extension = extensions[0]
    if extension.oid != ExtensionOID.SUBJECT_ALTERNATIVE_NAME:
        return False
    names = cast(x509.SubjectAlternativeName, extension.value)
    if len(names) != 1:
        return False
    name = next(iter(names))
    return type(name) is x509.UniformResourceIdentifier and name.value == identity.uri


def _checked_public_key(
    csr: x509.CertificateSigningRequest, loaded: CertificatePublicKeyTypes | None
) -> PublicKey:
    key = loaded if loaded is not None else csr.public_key()
    family = key_family(key)  # not isinstance: ABC checks cost on every request
    if family == "rsa":
        key_size = cast(rsa.RSAPublicKey, key).key_size
        if key_size < _MIN_RSA_BITS:
            raise InvalidRequestError(
                "csr-weak-key", f"CSR key is RSA-{key_size}; use RSA-2048 or larger, or ECDSA"
            )
        return cast(rsa.RSAPublicKey, key)
    if family == "ec":
        curve = cast(ec.EllipticCurvePublicKey, key).curve
        if curve.name not in _ACCEPTED_CURVES:
            raise InvalidRequestError(
                "csr-key-type", f"CSR key uses curve {curve.name}; use P-256 or P-384"
            )
        return cast(ec.EllipticCurvePublicKey, key)
    raise InvalidRequestError(
        "csr-key-type", f"CSR key type {type(key).__name__} is not supported; use ECDSA or RSA"
    )
