"""Certificate signing requests: building them (agent side) and reading them (CA side).

Reading is defensive: the CA receives CSRs from the network, so size, encoding and signature are
checked here before anything looks at the requested names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, cast

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtensionOID, SignatureAlgorithmOID

from certs.errors import CsrError
from certs.keys import PrivateKey, key_family, signature_hash_for
from certs.spiffe import SpiffeId

MAX_CSR_BYTES = 64 * 1024
_PEM_HEADER = "-----BEGIN CERTIFICATE REQUEST-----"
_PEM_FOOTER = "-----END CERTIFICATE REQUEST-----"
_ANY_PEM_HEADER = b"-----BEGIN "


def build_csr(key: PrivateKey, identity: SpiffeId) -> str:
    """A PEM CSR with an empty subject and exactly one URI SAN: the identity asked for."""
    builder = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]),
            critical=True,
        )
    )
    csr = builder.sign(key, signature_hash_for(key))
    return csr.public_bytes(Encoding.PEM).decode("ascii")


class VerifiedCsr(NamedTuple):
    """A CSR whose self-signature verified, and the public key it verified with: the key a
    certificate would certify, loaded once (loading an EC key checks its point: ~5 µs)."""

    csr: x509.CertificateSigningRequest
    public_key: CertificatePublicKeyTypes


# The ECDSA schemes whose CSRs are verified with `public_key.verify` directly (the signature
# algorithms agents use); any other algorithm goes through `is_signature_valid`.
_ECDSA_SCHEMES: dict[x509.ObjectIdentifier, ec.ECDSA] = {
    SignatureAlgorithmOID.ECDSA_WITH_SHA256: ec.ECDSA(hashes.SHA256()),
    SignatureAlgorithmOID.ECDSA_WITH_SHA384: ec.ECDSA(hashes.SHA384()),
}


def load_csr(pem: str | bytes, *, max_bytes: int = MAX_CSR_BYTES) -> x509.CertificateSigningRequest:
    """`load_verified_csr` without the key: a parsed CSR whose self-signature verified."""
    return load_verified_csr(pem, max_bytes=max_bytes).csr


def load_verified_csr(pem: str | bytes, *, max_bytes: int = MAX_CSR_BYTES) -> VerifiedCsr:
    """Parses a PEM CSR and verifies its self-signature.

    Raises `CsrError` naming the problem: too large, not PEM, not a CSR, more than one PEM
    block or text around the block (the CA refuses what it would otherwise silently ignore),
    a signature that does not verify (the requester does not hold the key it asks a
    certificate for), or extensions that do not parse (malformed, or one extension twice, e.g. a
    second subjectAltName).
    """
    raw = pem.encode("utf-8", "replace") if isinstance(pem, str) else pem
    if len(raw) > max_bytes:
        raise CsrError(f"CSR is {len(raw)} bytes; the limit is {max_bytes} bytes")
    if _PEM_HEADER.encode() not in raw:
        raise CsrError(f"CSR is not PEM: expected a '{_PEM_HEADER}' block")
    _check_single_block(raw)
    try:
        csr = x509.load_pem_x509_csr(raw)
    except (ValueError, x509.InvalidVersion) as exc:  # InvalidVersion is not a ValueError
        raise CsrError(f"CSR PEM block does not parse as PKCS#10 ({exc})") from exc
    try:
        public_key = csr.public_key()
        valid = _signature_verifies(csr, public_key)
    except Exception as exc:  # unsupported algorithms raise from deep inside the backend
        raise CsrError(f"CSR signature cannot be checked ({exc})") from exc
    if not valid:
        raise CsrError("CSR signature does not verify: it was not signed by the key it carries")
    try:
        _ = csr.extensions  # parsed lazily: fail here, as a bad CSR, not in a policy check
    except (ValueError, x509.DuplicateExtension) as exc:
        raise CsrError(f"CSR extensions do not parse ({exc})") from exc
    return VerifiedCsr(csr, public_key)


def _signature_verifies(
    csr: x509.CertificateSigningRequest, public_key: CertificatePublicKeyTypes
) -> bool:
    """What `csr.is_signature_valid` answers, without loading the key a second time.

    `is_signature_valid` loads the CSR's key again, checks that the key's type matches the
    signature algorithm and verifies over `tbs_certrequest_bytes` through a call back into
    Python: ~10 µs above the ECDSA verify itself, on every CSR. For an EC key under
    ECDSA-with-SHA256/384 this is the same check, done directly (same key, same bytes, same
    scheme; the property test in tests/certs/test_csr.py holds the two to the same verdicts);
    every other pairing, including a mismatched one, is left to `is_signature_valid`."""
    scheme = _ECDSA_SCHEMES.get(csr.signature_algorithm_oid)
    if scheme is None or key_family(public_key) != "ec":
        return csr.is_signature_valid
    try:
        cast(ec.EllipticCurvePublicKey, public_key).verify(
            csr.signature, csr.tbs_certrequest_bytes, scheme
        )
    except InvalidSignature:
        return False
    return True


def _check_single_block(raw: bytes) -> None:
    """Exactly one PEM block and nothing but whitespace around it: one CSR per request."""
    blocks = raw.count(_ANY_PEM_HEADER)
    if blocks > 1:
        raise CsrError(
            f"the csr field holds {blocks} PEM blocks; send exactly one "
            f"'{_PEM_HEADER}' block per request"
        )
    start = raw.index(_PEM_HEADER.encode())
    end = raw.find(_PEM_FOOTER.encode(), start)
    if end < 0:
        raise CsrError(f"CSR PEM block has no '{_PEM_FOOTER}' line")
    outside = raw[:start] + raw[end + len(_PEM_FOOTER) :]
    if outside.strip():
        raise CsrError(
            f"the csr field has {len(outside.strip())} bytes of other content around the PEM "
            "block; send only the block"
        )


@dataclass(frozen=True)
class CsrContents:
    """What a CSR asks for, in the terms an authorization policy needs."""

    uri_sans: tuple[str, ...]
    dns_sans: tuple[str, ...]
    ip_sans: tuple[str, ...]
    email_sans: tuple[str, ...]
    other_san_count: int
    asks_for_ca: bool
    extension_names: tuple[str, ...]
    subject: str
    # keyCertSign or cRLSign in a requested keyUsage: asking to sign certificates or CRLs.
    asks_to_sign_certificates: bool = False
    # Requested extensions other than subjectAltName, keyUsage and extendedKeyUsage.
    unexpected_extension_names: tuple[str, ...] = ()


_ALLOWED_EXTENSIONS = {
    ExtensionOID.SUBJECT_ALTERNATIVE_NAME,
    ExtensionOID.KEY_USAGE,
    ExtensionOID.EXTENDED_KEY_USAGE,
}

SanKind = Literal["uri", "dns", "ip", "email", "other"]
_SAN_KINDS: tuple[tuple[type[x509.GeneralName], SanKind], ...] = (
    (x509.UniformResourceIdentifier, "uri"),
    (x509.DNSName, "dns"),
    (x509.IPAddress, "ip"),
    (x509.RFC822Name, "email"),
)
_SAN_KIND_BY_TYPE: dict[type, SanKind] = {}
# The general names whose `.value` the lists hold.
_ValuedName = x509.UniformResourceIdentifier | x509.DNSName | x509.IPAddress | x509.RFC822Name


def _san_kind(general_name: x509.GeneralName) -> SanKind:
    """Which list a SAN entry goes to. Why not `isinstance` per entry: the general-name classes
    are ABCs, whose `__instancecheck__` runs in Python on the CA's per-request path; the answer
    depends only on the concrete type, so it is memoised per type (pure, holds no request
    state)."""
    kind_of = type(general_name)
    try:
        return _SAN_KIND_BY_TYPE[kind_of]
    except KeyError:
        kind: SanKind = "other"
        for cls, listed in _SAN_KINDS:
            if issubclass(kind_of, cls):
                kind = listed
                break
        _SAN_KIND_BY_TYPE[kind_of] = kind
        return kind


def describe_csr(csr: x509.CertificateSigningRequest) -> CsrContents:
    """Splits a CSR's requested names and extensions by kind, in one pass over the extensions
    (the CA calls this for every request). Extensions are told apart by OID: cryptography
    parses each known OID to exactly one class, so the OID says what `ext.value` is."""
    sans: dict[SanKind, list[str]] = {"uri": [], "dns": [], "ip": [], "email": []}
    others = 0
    asks_for_ca = False
    asks_to_sign = False
    names: list[str] = []
    unexpected: list[str] = []
    for ext in csr.extensions:
        oid = ext.oid
        name = _extension_name(oid)
        names.append(name)
        if oid not in _ALLOWED_EXTENSIONS:
            unexpected.append(name)
        if oid == ExtensionOID.SUBJECT_ALTERNATIVE_NAME:
            for general_name in cast(x509.SubjectAlternativeName, ext.value):
                kind = _san_kind(general_name)
                if kind == "other":
                    others += 1
                else:
                    sans[kind].append(str(cast(_ValuedName, general_name).value))
        elif oid == ExtensionOID.BASIC_CONSTRAINTS:
            asks_for_ca = asks_for_ca or cast(x509.BasicConstraints, ext.value).ca
        elif oid == ExtensionOID.KEY_USAGE:
            usage = cast(x509.KeyUsage, ext.value)
            asks_to_sign = usage.key_cert_sign or usage.crl_sign
    return CsrContents(
        uri_sans=tuple(sans["uri"]),
        dns_sans=tuple(sans["dns"]),
        ip_sans=tuple(sans["ip"]),
        email_sans=tuple(sans["email"]),
        other_san_count=others,
        asks_for_ca=asks_for_ca,
        extension_names=tuple(names),
        subject=csr.subject.rfc4514_string(),
        asks_to_sign_certificates=asks_to_sign,
        unexpected_extension_names=tuple(unexpected),
    )


def unexpected_extensions(csr: x509.CertificateSigningRequest) -> list[str]:
    """Names of requested extensions other than SAN, KeyUsage and ExtendedKeyUsage."""
    return list(describe_csr(csr).unexpected_extension_names)


def _extension_name(oid: x509.ObjectIdentifier) -> str:
    """The extension's well-known name, or its dotted OID when cryptography has no name for it."""
    name = oid._name
    return oid.dotted_string if name == "Unknown OID" else name
