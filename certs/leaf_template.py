"""Workload leaves signed from a DER template: the builder's bytes at a fraction of its cost.

Why: `CertificateBuilder(...).sign()` re-encodes the issuer Name, the AKI and the fixed
extensions, and builds Python objects for every part, on every leaf, although only the serial,
the validity, the SPIFFE URI and the key change between two leaves of one issuer. Here the
issuer-dependent DER (signature AlgorithmIdentifier, issuer Name, KeyUsage, ExtendedKeyUsage,
BasicConstraints, AKI) is encoded once per authority, from the very values
`certs.profile.WorkloadLeafProfile` hands the builder; per leaf only the serial, the validity,
the URI SAN and the SubjectPublicKeyInfo are encoded, the TBSCertificate is signed with
`key.sign(tbs)` and wrapped.

The guarantee, held by tests/certs/test_leaf_template.py: for the same key, identity, serial and
validity the TBSCertificate is byte-identical to what `WorkloadLeafProfile.build` signs (for an
RSA issuer, PKCS#1 v1.5 being deterministic, the whole certificate is). `WorkloadLeafProfile`
stays the reference; a change to the leaf profile is made there and here together, and the
property test fails until both agree.

The SubjectPublicKeyInfo is always in canonical shape (named curve, uncompressed point;
rsaEncryption with NULL parameters): an EC key's is sliced from the verified CSR when it has
exactly that shape, and anything else (a compressed point, say, or any RSA key) is cryptography's
own encoding of the key (`public_bytes`), the call the builder makes. Key types and sizes
outside meshca's policy (ECDSA P-256/P-384, RSA of 2048 bits or more) are refused here too, as
`KeyMaterialError`, so no caller can sign one by skipping the CSR checks.

Pure: no clock (the caller gives the validity), no I/O; the template is an immutable value held
by the `SigningAuthority` it was derived from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from certs.errors import KeyMaterialError
from certs.keys import PrivateKey, PublicKey, key_family
from certs.profile import LEAF_SAN_CRITICAL, WorkloadLeafProfile, random_serial
from certs.spiffe import SpiffeId

# The key policy of the CA's CSR checks (ca_server.authz), restated where the key is encoded.
_MIN_LEAF_RSA_BITS = 2048

# cryptography's rules for the serial and the validity (`CertificateBuilder.serial_number`,
# `not_valid_before`/`not_valid_after`), kept so the template refuses what the builder refuses.
_MAX_SERIAL_BITS = 159
_EARLIEST_YEAR = 1950  # the builder refuses times before 1950-01-01T00:00:00
_GENERALIZED_TIME_FROM_YEAR = 2050  # RFC 5280 4.1.2.5: UTCTime through 2049

# SubjectPublicKeyInfo up to and including the 0x04 of an uncompressed point, per leaf curve
# (the leaf policy's curves: ca_server.authz refuses others before signing).
_UNCOMPRESSED_SPKI_PREFIX = {
    "secp256r1": bytes.fromhex("3059301306072a8648ce3d020106082a8648ce3d03010703420004"),
    "secp384r1": bytes.fromhex("3076301006072a8648ce3d020106052b8104002203620004"),
}
_POINT_OCTETS = {"secp256r1": 64, "secp384r1": 96}  # X and Y after the 0x04
_SHA256_WITH_RSA = bytes.fromhex("300d06092a864886f70d01010b0500")
_SHA384_WITH_RSA = bytes.fromhex("300d06092a864886f70d01010c0500")
_ECDSA_WITH_SHA256 = bytes.fromhex("300a06082a8648ce3d040302")
_ECDSA_WITH_SHA384 = bytes.fromhex("300a06082a8648ce3d040303")
_VERSION_3 = bytes.fromhex("a003020102")
_EMPTY_NAME = bytes.fromhex("3000")
_SAN_OID = bytes.fromhex("0603551d11")
_CRITICAL = bytes.fromhex("0101ff")
_URI_TAG = b"\x86"  # GeneralName uniformResourceIdentifier [6] IA5String, implicit


def _encode_length(length: int) -> bytes:
    if length < 0x80:
        return bytes((length,))
    octets = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes((0x80 | len(octets),)) + octets


# Every length a leaf's SAN and extensions can have (a SPIFFE ID is at most 588 characters),
# encoded once: ten lengths per leaf, looked up rather than computed.
_LENGTHS = tuple(_encode_length(length) for length in range(2048))


def _der_length(length: int) -> bytes:
    return _LENGTHS[length] if length < 2048 else _encode_length(length)


def _tlv(tag: bytes, content: bytes) -> bytes:
    return tag + _der_length(len(content)) + content


def _sequence(*parts: bytes) -> bytes:
    return _tlv(b"\x30", b"".join(parts))


def der_oid(oid: x509.ObjectIdentifier) -> bytes:
    """OBJECT IDENTIFIER: the first two arcs in one octet, then base-128 arcs."""
    arcs = [int(arc) for arc in oid.dotted_string.split(".")]
    content = bytearray()
    for arc in [arcs[0] * 40 + arcs[1], *arcs[2:]]:
        septets = [arc & 0x7F]
        arc >>= 7
        while arc:
            septets.append(0x80 | (arc & 0x7F))
            arc >>= 7
        content.extend(reversed(septets))
    return _tlv(b"\x06", bytes(content))


def _extension(oid: bytes, value: bytes, *, critical: bool) -> bytes:
    """Extension ::= SEQUENCE { extnID, critical BOOLEAN DEFAULT FALSE, extnValue OCTET STRING }
    (DER omits a FALSE default)."""
    return _sequence(oid, _CRITICAL if critical else b"", _tlv(b"\x04", value))


def der_serial(serial: int) -> bytes:
    """A positive serial as a minimal DER INTEGER: a leading zero octet only when the high bit of
    the first octet is set (128 is 02 02 00 80, 127 is 02 01 7f)."""
    if serial <= 0:
        raise ValueError("The serial number should be positive.")
    if serial.bit_length() > _MAX_SERIAL_BITS:
        raise ValueError("The serial number should not be more than 159 bits.")
    return _tlv(b"\x02", serial.to_bytes(serial.bit_length() // 8 + 1, "big"))


def _in_utc(moment: datetime) -> datetime:
    """Like the builder: an aware time converted to UTC (naive), a naive one taken as UTC. A
    time already in `UTC` is used as it is: its fields are the UTC fields (and `replace` would
    cost more than the encoding)."""
    zone = moment.tzinfo
    if zone is not None and zone is not UTC:
        moment = moment.replace(tzinfo=None) - (moment.utcoffset() or timedelta())
    if moment.year < _EARLIEST_YEAR:
        raise ValueError("certificate times must be on or after 1950 January 1")
    return moment


def _der_utc_time(moment: datetime) -> bytes:
    # %-formatting of bytes, not strftime: a third of the cost, on every leaf.
    fields = (moment.month, moment.day, moment.hour, moment.minute, moment.second)
    if moment.year < _GENERALIZED_TIME_FROM_YEAR:
        return b"\x17\x0d%02d%02d%02d%02d%02d%02dZ" % (moment.year % 100, *fields)
    return b"\x18\x0f%04d%02d%02d%02d%02d%02dZ" % (moment.year, *fields)


def der_time(moment: datetime) -> bytes:
    """UTCTime (YYMMDDHHMMSSZ) before 2050, GeneralizedTime (YYYYMMDDHHMMSSZ) from 2050, whole
    seconds (the builder drops microseconds too)."""
    return _der_utc_time(_in_utc(moment))


def _der_validity(not_before: datetime, not_after: datetime) -> bytes:
    """Validity ::= SEQUENCE { notBefore, notAfter }."""
    if (
        not_before.tzinfo is UTC
        and not_after.tzinfo is UTC
        and not_before.year >= _EARLIEST_YEAR
        and not_after.year < _GENERALIZED_TIME_FROM_YEAR
        and not_before <= not_after
    ):  # the CA's case (aware UTC times, before 2050): one formatting call for both times
        return b"\x30\x1e\x17\x0d%02d%02d%02d%02d%02d%02dZ\x17\x0d%02d%02d%02d%02d%02d%02dZ" % (
            not_before.year % 100,
            not_before.month,
            not_before.day,
            not_before.hour,
            not_before.minute,
            not_before.second,
            not_after.year % 100,
            not_after.month,
            not_after.day,
            not_after.hour,
            not_after.minute,
            not_after.second,
        )
    start, end = _in_utc(not_before), _in_utc(not_after)
    if (start.tzinfo is None) != (end.tzinfo is None):  # one was given in UTC, one naive
        start, end = start.replace(tzinfo=None), end.replace(tzinfo=None)
    if start > end:
        raise ValueError("The not valid after date must be after the not valid before date.")
    return _tlv(b"\x30", _der_utc_time(start) + _der_utc_time(end))


def subject_public_key_info(
    public_key: PublicKey, csr: x509.CertificateSigningRequest | None = None
) -> bytes:
    """The key's DER SubjectPublicKeyInfo in canonical shape, refused outside the leaf policy.

    With `csr` (the verified CSR `public_key` was read from), an EC key's SPKI is sliced from
    the CSR when it already has the one canonical shape for its curve: named curve, uncompressed
    point, nothing else (a fixed prefix and length). The point is on the curve: cryptography
    refused to load the key otherwise, and the CSR's signature verified with it. Anything else
    (a compressed point, explicit curve parameters, an RSA key) is re-encoded by cryptography's
    own encoder, the call `CertificateBuilder` makes, which always writes the canonical shape.
    Why slice: for EC the encoder costs ~3 µs, a tenth of the whole leaf."""
    family = key_family(public_key)
    if family == "ec":
        curve = cast(ec.EllipticCurvePublicKey, public_key).curve.name
        prefix = _UNCOMPRESSED_SPKI_PREFIX.get(curve)
        if prefix is None:
            raise KeyMaterialError(f"leaf key uses curve {curve}; use P-256 or P-384")
        if csr is not None:
            sliced = _csr_spki(csr.tbs_certrequest_bytes)
            if len(sliced) == len(prefix) + _POINT_OCTETS[curve] and sliced.startswith(prefix):
                return sliced
    elif family == "rsa":
        bits = cast(rsa.RSAPublicKey, public_key).key_size
        if bits < _MIN_LEAF_RSA_BITS:
            raise KeyMaterialError(f"leaf key is RSA-{bits}; use RSA-2048 or larger, or ECDSA")
    else:
        raise KeyMaterialError(
            f"leaf key type {type(public_key).__name__} is not supported; use ECDSA or RSA"
        )
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _tlv_end(der: bytes, start: int) -> int:
    """Where the DER element starting at `start` ends (the input is cryptography's own DER)."""
    first = der[start + 1]
    if first < 0x80:
        return start + 2 + first
    count = first & 0x7F
    return start + 2 + count + int.from_bytes(der[start + 2 : start + 2 + count], "big")


def _csr_spki(info: bytes) -> bytes:
    """CertificationRequestInfo ::= SEQUENCE { version, subject, subjectPKInfo, attributes }."""
    start = 2 if info[1] < 0x80 else 2 + (info[1] & 0x7F)
    start = _tlv_end(info, _tlv_end(info, start))  # past the version and the subject
    return info[start : _tlv_end(info, start)]


def _signature_algorithm(issuer_key: PrivateKey, hash_algorithm: hashes.HashAlgorithm) -> bytes:
    sha384 = isinstance(hash_algorithm, hashes.SHA384)
    if key_family(issuer_key) == "rsa":
        return _SHA384_WITH_RSA if sha384 else _SHA256_WITH_RSA
    return _ECDSA_WITH_SHA384 if sha384 else _ECDSA_WITH_SHA256


@dataclass(frozen=True)
class LeafTemplate:
    """The workload leaf profile of one issuer as DER pieces (see the module docstring).

    `issuer_part` runs from the signature AlgorithmIdentifier through the issuer Name;
    `extensions_tail` holds the fixed extensions after the SAN; the issuer key is held only
    inside the bound signing function. Built with `for_issuer`, or once per authority by
    `SigningAuthority.leaf_template`."""

    signature_algorithm: bytes
    issuer_part: bytes
    extensions_tail: bytes
    san_head: bytes  # the SAN extension's extnID and critical flag
    _sign_tbs: Callable[[bytes], bytes] = field(repr=False, compare=False)

    @classmethod
    def for_issuer(cls, issuer_cert: x509.Certificate, issuer_key: PrivateKey) -> LeafTemplate:
        return cls.from_profile(WorkloadLeafProfile.for_issuer(issuer_cert, issuer_key))

    @classmethod
    def from_profile(cls, profile: WorkloadLeafProfile) -> LeafTemplate:
        """Encodes what `profile.build` adds to every leaf, from the same values."""
        algorithm = _signature_algorithm(profile.issuer_key, profile.signature_hash)
        tail = b"".join(
            _extension(der_oid(extension.oid), extension.public_bytes(), critical=critical)
            for extension, critical in profile.fixed_extensions
        )
        return cls(
            signature_algorithm=algorithm,
            issuer_part=algorithm + profile.issuer_name.public_bytes(),
            extensions_tail=tail,
            san_head=_SAN_OID + (_CRITICAL if LEAF_SAN_CRITICAL else b""),
            _sign_tbs=_tbs_signer(profile.issuer_key, profile.signature_hash),
        )

    def tbs_certificate(
        self,
        public_key: PublicKey,
        identity: SpiffeId,
        *,
        not_before: datetime,
        not_after: datetime,
        serial: int,
        csr: x509.CertificateSigningRequest | None = None,
    ) -> bytes:
        """The DER TBSCertificate: empty subject, critical SPIFFE URI SAN, the fixed extensions."""
        uri = identity.uri.encode("ascii")  # SpiffeId admits only ASCII
        # Extension { extnID subjectAltName, critical, OCTET STRING { GeneralNames { [6] uri } } }
        lengths = _LENGTHS  # a SPIFFE URI is at most 588 octets: these three are in the table
        general_name = _URI_TAG + lengths[len(uri)] + uri
        names = b"\x30" + lengths[len(general_name)] + general_name
        san_body = self.san_head + b"\x04" + lengths[len(names)] + names
        extensions = b"\x30" + _der_length(len(san_body)) + san_body + self.extensions_tail
        extensions = b"\x30" + _der_length(len(extensions)) + extensions
        body = b"".join(
            (
                _VERSION_3,
                der_serial(serial),
                self.issuer_part,
                _der_validity(not_before, not_after),
                _EMPTY_NAME,
                subject_public_key_info(public_key, csr),
                b"\xa3",
                _der_length(len(extensions)),
                extensions,
            )
        )
        return b"\x30" + _der_length(len(body)) + body

    def sign(
        self,
        public_key: PublicKey,
        identity: SpiffeId,
        *,
        not_before: datetime,
        not_after: datetime,
        serial: int | None = None,
        csr: x509.CertificateSigningRequest | None = None,
    ) -> bytes:
        """The DER certificate `WorkloadLeafProfile.build` would sign, from the same arguments.

        `not_before`/`not_after` are taken as given: the caller's TTL policy applies the
        backdate and the clamp to the chain's expiry, exactly as for the builder. `csr`, the
        verified CSR `public_key` was read from, lets an EC key's SPKI be sliced rather than
        re-encoded (`subject_public_key_info`)."""
        tbs = self.tbs_certificate(
            public_key,
            identity,
            not_before=not_before,
            not_after=not_after,
            serial=serial or random_serial(),
            csr=csr,
        )
        signature = self._sign_tbs(tbs)
        # Certificate ::= SEQUENCE { tbs, signatureAlgorithm, BIT STRING (no unused bits) }
        body = b"".join(
            (tbs, self.signature_algorithm, b"\x03", _der_length(len(signature) + 1), b"\x00")
        )
        return b"\x30" + _der_length(len(body) + len(signature)) + body + signature


def _tbs_signer(
    key: PrivateKey, hash_algorithm: hashes.SHA256 | hashes.SHA384
) -> Callable[[bytes], bytes]:
    """`key.sign` bound to the profile's scheme: ECDSA with the hash, or RSA PKCS#1 v1.5."""
    if key_family(key) == "rsa":
        rsa_key = cast(rsa.RSAPrivateKey, key)
        scheme = padding.PKCS1v15()
        return lambda tbs: rsa_key.sign(tbs, scheme, hash_algorithm)
    ec_key = cast(ec.EllipticCurvePrivateKey, key)
    ecdsa = ec.ECDSA(hash_algorithm)
    return lambda tbs: ec_key.sign(tbs, ecdsa)
