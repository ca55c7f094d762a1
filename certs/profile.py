"""The certificate profiles meshca signs: workload leaves, CA certificates and serving certs.

Every function takes its time (`now`) and lifetimes from the caller, so the CA and tests decide
what time it is; nothing here reads a clock.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.keys import PrivateKey, PublicKey, signature_hash_for
from certs.spiffe import SpiffeId

CLOCK_SKEW_BACKDATE = timedelta(minutes=2)


def random_serial() -> int:
    """A positive random serial of 128 bits (RFC 5280 allows up to 20 octets)."""
    return secrets.randbits(127) | (1 << 126)


def _key_usage(
    *, digital_signature: bool = False, key_encipherment: bool = False, cert_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


# What every workload leaf carries besides its key, identity, serial and validity (immutable
# values, shared by every leaf).
_EMPTY_SUBJECT = x509.Name([])
_LEAF_KEY_USAGE = _key_usage(digital_signature=True, key_encipherment=True)
_LEAF_EXTENDED_KEY_USAGE = x509.ExtendedKeyUsage(
    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
)
_NOT_A_CA = x509.BasicConstraints(ca=False, path_length=None)
LEAF_SAN_CRITICAL = True  # the SPIFFE URI SAN is the whole (empty-subject) name


@dataclass(frozen=True)
class WorkloadLeafProfile:
    """The workload leaf profile bound to one issuer (docs/reference.md#workload-certificate).

    Why a value rather than a function of the issuer: the CA signs every workload leaf with
    the same issuer until its authority changes, and what depends only on the issuer (its
    name, the Authority Key Identifier, the signature hash) costs a few microseconds to derive
    per leaf. `SigningAuthority.leaf_profile` builds it once per authority.
    """

    issuer_name: x509.Name
    issuer_key: PrivateKey = field(repr=False)
    authority_key_id: x509.AuthorityKeyIdentifier
    signature_hash: hashes.SHA256 | hashes.SHA384

    @classmethod
    def for_issuer(
        cls, issuer_cert: x509.Certificate, issuer_key: PrivateKey
    ) -> WorkloadLeafProfile:
        return cls(
            issuer_name=issuer_cert.subject,
            issuer_key=issuer_key,
            authority_key_id=_authority_key_id(issuer_cert),
            signature_hash=signature_hash_for(issuer_key),
        )

    def build(
        self,
        public_key: PublicKey,
        identity: SpiffeId,
        *,
        not_before: datetime,
        not_after: datetime,
        serial: int | None = None,
    ) -> x509.Certificate:
        """Empty subject, critical SPIFFE URI SAN, CA:false, signed by the issuer.

        `not_before`/`not_after` are taken as given; the caller (the CA's TTL policy) applies
        the backdate and the clamp to the issuer's expiry.
        """
        builder = (
            x509.CertificateBuilder()
            .subject_name(_EMPTY_SUBJECT)
            .issuer_name(self.issuer_name)
            .public_key(public_key)
            .serial_number(serial or random_serial())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]),
                critical=LEAF_SAN_CRITICAL,
            )
        )
        for extension, critical in self.fixed_extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(self.issuer_key, self.signature_hash)

    @property
    def fixed_extensions(self) -> tuple[tuple[x509.ExtensionType, bool], ...]:
        """What every leaf of this issuer carries after its SAN: (extension, critical), in
        order. One list for `build` and `certs.leaf_template`, so the two cannot drift."""
        return (
            (_LEAF_KEY_USAGE, True),
            (_LEAF_EXTENDED_KEY_USAGE, False),
            (_NOT_A_CA, True),
            (self.authority_key_id, False),
        )


def build_workload_certificate(
    public_key: PublicKey,
    identity: SpiffeId,
    issuer_cert: x509.Certificate,
    issuer_key: PrivateKey,
    *,
    not_before: datetime,
    not_after: datetime,
    serial: int | None = None,
) -> x509.Certificate:
    """The workload leaf signed by `issuer_cert`/`issuer_key` (see `WorkloadLeafProfile`)."""
    return WorkloadLeafProfile.for_issuer(issuer_cert, issuer_key).build(
        public_key, identity, not_before=not_before, not_after=not_after, serial=serial
    )


def build_root_certificate(
    key: PrivateKey,
    trust_domain: str,
    *,
    now: datetime,
    lifetime: timedelta,
    common_name: str = "meshca root",
) -> x509.Certificate:
    """A self-signed root: `O=<trust domain>`, CA:true, keyCertSign+cRLSign, backdated 2 min."""
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    subject_key_id = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(random_serial())
        .not_valid_before(now - CLOCK_SKEW_BACKDATE)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(subject_key_id, critical=False)
    )
    return builder.sign(key, signature_hash_for(key))


def build_intermediate_certificate(
    public_key: PublicKey,
    issuer_cert: x509.Certificate,
    issuer_key: PrivateKey,
    trust_domain: str,
    *,
    now: datetime,
    lifetime: timedelta,
    common_name: str = "meshca intermediate",
    path_length: int | None = 0,
) -> x509.Certificate:
    """A CA certificate signed by `issuer_cert` (plugged-in CAs, and rotation later)."""
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    not_after = min(now + lifetime, issuer_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_cert.subject)
        .public_key(public_key)
        .serial_number(random_serial())
        .not_valid_before(now - CLOCK_SKEW_BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(_authority_key_id(issuer_cert), critical=False)
    )
    return builder.sign(issuer_key, signature_hash_for(issuer_key))


def build_serving_certificate(
    public_key: PublicKey,
    issuer_cert: x509.Certificate,
    issuer_key: PrivateKey,
    *,
    hosts: Sequence[str],
    now: datetime,
    lifetime: timedelta,
) -> x509.Certificate:
    """The CA's own TLS server certificate: DNS and IP SANs for the addresses clients dial."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    not_after = min(now + lifetime, issuer_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "meshca")])
        )
        .issuer_name(issuer_cert.subject)
        .public_key(public_key)
        .serial_number(random_serial())
        .not_valid_before(now - CLOCK_SKEW_BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(_key_usage(digital_signature=True, key_encipherment=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_authority_key_id(issuer_cert), critical=False)
    )
    return builder.sign(issuer_key, signature_hash_for(issuer_key))


def issuer_key_id(cert: x509.Certificate) -> str | None:
    """The Subject Key ID, in hex, of the authority that signed `cert`, from its Authority Key
    Identifier (what meshca calls the leaf's authority); None without one."""
    try:
        aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    except x509.ExtensionNotFound:
        return None
    return aki.key_identifier.hex() if aki.key_identifier else None


def _authority_key_id(issuer_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    """AKI from the issuer's SKI when it has one, else derived from its public key."""
    try:
        ski = issuer_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_cert.public_key())  # type: ignore[arg-type]
