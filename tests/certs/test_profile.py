from __future__ import annotations

import ipaddress
from datetime import timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID

from certs import (
    CLOCK_SKEW_BACKDATE,
    KeySpec,
    build_intermediate_certificate,
    build_root_certificate,
    build_serving_certificate,
    build_workload_certificate,
    generate_private_key,
    is_ca,
    make_authority,
    random_serial,
)
from certs.keys import public_key_bytes
from tests.support.pki_views import IDENTITY, NOW, TRUST_DOMAIN, Pki, make_leaf


def _ext(cert: x509.Certificate, cls: type[x509.ExtensionType]) -> x509.Extension:
    return cert.extensions.get_extension_for_class(cls)


def _ski(cert: x509.Certificate) -> bytes:
    return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest


def test_clock_skew_backdate_is_two_minutes() -> None:
    assert timedelta(minutes=2) == CLOCK_SKEW_BACKDATE


def test_random_serial_is_positive_at_most_128_bits_and_random() -> None:
    serials = [random_serial() for _ in range(200)]
    assert all(s > 0 for s in serials)
    assert all(s.bit_length() <= 128 for s in serials)
    # Enough entropy to be unguessable: far more than 64 bits in use, and no repeats.
    assert all(s.bit_length() > 64 for s in serials)
    assert len(set(serials)) == len(serials)
    # The low bits vary (not a counter or a constant pattern).
    assert len({s & 0xFFFF for s in serials}) > 150


class TestWorkloadLeaf:
    """docs/reference.md#workload-certificate."""

    @pytest.fixture
    def leaf(self, pki: Pki) -> x509.Certificate:
        return make_leaf(pki)

    def test_serial_positive_and_at_most_128_bits(self, pki: Pki, leaf: x509.Certificate) -> None:
        assert 0 < leaf.serial_number < 2**128
        assert make_leaf(pki).serial_number != leaf.serial_number

    def test_explicit_serial_is_used(self, pki: Pki) -> None:
        cert = build_workload_certificate(
            pki.leaf_key.public_key(),
            IDENTITY,
            pki.root,
            pki.root_key,
            not_before=NOW,
            not_after=NOW + timedelta(hours=1),
            serial=12345,
        )
        assert cert.serial_number == 12345

    def test_subject_is_empty_and_issuer_is_the_ca(self, pki: Pki, leaf: x509.Certificate) -> None:
        assert leaf.subject == x509.Name([])
        assert leaf.issuer == pki.intermediate.subject

    def test_san_is_the_spiffe_uri_and_critical(self, leaf: x509.Certificate) -> None:
        san = _ext(leaf, x509.SubjectAlternativeName)
        assert san.critical
        assert list(san.value) == [x509.UniformResourceIdentifier(IDENTITY.uri)]

    def test_key_usage(self, leaf: x509.Certificate) -> None:
        ku = _ext(leaf, x509.KeyUsage)
        assert ku.critical
        value = ku.value
        assert value.digital_signature and value.key_encipherment
        assert not (
            value.content_commitment
            or value.data_encipherment
            or value.key_agreement
            or value.key_cert_sign
            or value.crl_sign
        )

    def test_extended_key_usage(self, leaf: x509.Certificate) -> None:
        eku = _ext(leaf, x509.ExtendedKeyUsage).value
        assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}

    def test_not_a_ca(self, leaf: x509.Certificate) -> None:
        bc = _ext(leaf, x509.BasicConstraints)
        assert bc.value.ca is False
        assert not is_ca(leaf)

    def test_authority_key_id_is_the_issuers_subject_key_id(
        self, pki: Pki, leaf: x509.Certificate
    ) -> None:
        aki = _ext(leaf, x509.AuthorityKeyIdentifier).value
        assert aki.key_identifier == _ski(pki.intermediate)
        direct = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
        assert _ext(direct, x509.AuthorityKeyIdentifier).value.key_identifier == _ski(pki.root)

    def test_aki_falls_back_to_issuer_public_key(self, pki: Pki) -> None:
        """An issuer without SKI (some plugged-in CAs) still gets an AKI, from its key."""
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "no-ski")])
        issuer = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(pki.root_key.public_key())
            .serial_number(7)
            .not_valid_before(NOW - timedelta(days=1))
            .not_valid_after(NOW + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(pki.root_key, hashes.SHA256())
        )
        leaf = make_leaf(pki, issuer=issuer, issuer_key=pki.root_key)
        aki = _ext(leaf, x509.AuthorityKeyIdentifier).value
        expected = x509.SubjectKeyIdentifier.from_public_key(pki.root_key.public_key()).digest
        assert aki.key_identifier == expected

    def test_exactly_the_profile_extensions(self, leaf: x509.Certificate) -> None:
        assert {ext.oid for ext in leaf.extensions} == {
            ExtensionOID.SUBJECT_ALTERNATIVE_NAME,
            ExtensionOID.KEY_USAGE,
            ExtensionOID.EXTENDED_KEY_USAGE,
            ExtensionOID.BASIC_CONSTRAINTS,
            ExtensionOID.AUTHORITY_KEY_IDENTIFIER,
        }

    def test_validity_taken_as_given(self, pki: Pki) -> None:
        not_before = NOW - timedelta(minutes=2)
        not_after = NOW + timedelta(hours=5, minutes=7)
        cert = make_leaf(pki, not_before=not_before, not_after=not_after)
        assert cert.not_valid_before_utc == not_before
        assert cert.not_valid_after_utc == not_after

    def test_signed_by_issuer_and_certifies_the_key(self, pki: Pki, leaf: x509.Certificate) -> None:
        leaf.verify_directly_issued_by(pki.intermediate)
        assert public_key_bytes(leaf.public_key()) == public_key_bytes(pki.leaf_key)  # type: ignore[arg-type]

    def test_rsa_issuer_and_rsa_workload_key(self) -> None:
        root_key = generate_private_key(KeySpec("RSA"))
        root = build_root_certificate(root_key, TRUST_DOMAIN, now=NOW, lifetime=timedelta(days=1))
        cert = build_workload_certificate(
            generate_private_key(KeySpec("ECDSA", curve="P384")).public_key(),
            IDENTITY,
            root,
            root_key,
            not_before=NOW,
            not_after=NOW + timedelta(hours=1),
        )
        cert.verify_directly_issued_by(root)
        assert isinstance(cert.signature_hash_algorithm, hashes.SHA256)


class TestRoot:
    def test_self_signed_ca_with_trust_domain_org(self) -> None:
        key = generate_private_key(KeySpec("RSA"))  # Istio's self-signed root is RSA-2048
        root = build_root_certificate(
            key, "example.org", now=NOW, lifetime=timedelta(days=3650), common_name="my root"
        )
        assert root.subject == root.issuer
        assert root.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
            "example.org"
        )
        assert root.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "my root"
        root.verify_directly_issued_by(root)
        bc = _ext(root, x509.BasicConstraints)
        assert bc.critical and bc.value.ca
        assert is_ca(root)
        ku = _ext(root, x509.KeyUsage)
        assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign
        assert not ku.value.digital_signature
        assert _ski(root) == x509.SubjectKeyIdentifier.from_public_key(key.public_key()).digest
        assert 0 < root.serial_number < 2**128

    def test_validity_backdated_and_lifetime(self, pki: Pki) -> None:
        root = build_root_certificate(
            pki.root_key, TRUST_DOMAIN, now=NOW, lifetime=timedelta(days=3650)
        )
        assert root.not_valid_before_utc == NOW - CLOCK_SKEW_BACKDATE
        assert root.not_valid_after_utc == NOW + timedelta(days=3650)


class TestIntermediate:
    def test_ca_signed_by_issuer(self, pki: Pki) -> None:
        cert = pki.intermediate
        cert.verify_directly_issued_by(pki.root)
        assert cert.issuer == pki.root.subject
        assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
            TRUST_DOMAIN
        )
        bc = _ext(cert, x509.BasicConstraints)
        assert bc.critical and bc.value.ca and bc.value.path_length == 0
        ku = _ext(cert, x509.KeyUsage)
        assert ku.critical and ku.value.key_cert_sign
        assert _ext(cert, x509.AuthorityKeyIdentifier).value.key_identifier == _ski(pki.root)
        assert _ski(cert) == (
            x509.SubjectKeyIdentifier.from_public_key(pki.intermediate_key.public_key()).digest
        )

    def test_lifetime_within_issuer(self, pki: Pki) -> None:
        cert = build_intermediate_certificate(
            pki.intermediate_key.public_key(),
            pki.root,
            pki.root_key,
            TRUST_DOMAIN,
            now=NOW,
            lifetime=timedelta(days=30),
            path_length=None,
        )
        assert cert.not_valid_before_utc == NOW - CLOCK_SKEW_BACKDATE
        assert cert.not_valid_after_utc == NOW + timedelta(days=30)
        assert _ext(cert, x509.BasicConstraints).value.path_length is None

    def test_clamped_to_issuer_expiry(self, pki: Pki) -> None:
        short_root = build_root_certificate(
            pki.root_key, TRUST_DOMAIN, now=NOW, lifetime=timedelta(days=10)
        )
        cert = build_intermediate_certificate(
            pki.intermediate_key.public_key(),
            short_root,
            pki.root_key,
            TRUST_DOMAIN,
            now=NOW,
            lifetime=timedelta(days=365),
        )
        assert cert.not_valid_after_utc == short_root.not_valid_after_utc
        assert cert.not_valid_after_utc == NOW + timedelta(days=10)


class TestServing:
    def test_hosts_become_dns_or_ip_sans(self, pki: Pki) -> None:
        cert = build_serving_certificate(
            pki.leaf_key.public_key(),
            pki.root,
            pki.root_key,
            hosts=["meshca.istio-system.svc", "127.0.0.1", "::1", "localhost", "10.1.2.3"],
            now=NOW,
            lifetime=timedelta(days=1),
        )
        san = _ext(cert, x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["meshca.istio-system.svc", "localhost"]
        assert san.get_values_for_type(x509.IPAddress) == [
            ipaddress.ip_address("127.0.0.1"),
            ipaddress.ip_address("::1"),
            ipaddress.ip_address("10.1.2.3"),
        ]
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
            "meshca.istio-system.svc"
        )
        assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
        assert not is_ca(cert)
        assert cert.not_valid_before_utc == NOW - CLOCK_SKEW_BACKDATE
        assert cert.not_valid_after_utc == NOW + timedelta(days=1)
        cert.verify_directly_issued_by(pki.root)

    def test_clamped_to_issuer_expiry(self, pki: Pki) -> None:
        cert = build_serving_certificate(
            pki.leaf_key.public_key(),
            pki.intermediate,
            pki.intermediate_key,
            hosts=["localhost"],
            now=NOW,
            lifetime=timedelta(days=5000),
        )
        assert cert.not_valid_after_utc == pki.intermediate.not_valid_after_utc


def test_authority_leaf_profile_is_derived_once_and_builds_the_same_leaf(pki: Pki) -> None:
    """The CA signs with `SigningAuthority.leaf_profile` (issuer name, AKI and hash derived once
    per authority); its leaves must be byte for byte what `build_workload_certificate` builds
    from the issuer each time (same serial and validity give the same TBSCertificate)."""
    authority = make_authority(pki.intermediate, pki.intermediate_key, [], [pki.root])
    assert authority.leaf_profile is authority.leaf_profile
    serial = random_serial()
    not_before, not_after = NOW - timedelta(minutes=2), NOW + timedelta(hours=1)
    public_key = pki.leaf_key.public_key()
    from_profile = authority.leaf_profile.build(
        public_key, IDENTITY, not_before=not_before, not_after=not_after, serial=serial
    )
    from_issuer = build_workload_certificate(
        public_key,
        IDENTITY,
        pki.intermediate,
        pki.intermediate_key,
        not_before=not_before,
        not_after=not_after,
        serial=serial,
    )
    assert from_profile.tbs_certificate_bytes == from_issuer.tbs_certificate_bytes
    assert _ext(from_profile, x509.AuthorityKeyIdentifier).value.key_identifier == _ski(
        pki.intermediate
    )
    # A different authority gets its own profile: the root as issuer.
    root_authority = make_authority(pki.root, pki.root_key, [], [pki.root])
    from_root = root_authority.leaf_profile.build(
        public_key, IDENTITY, not_before=not_before, not_after=not_after
    )
    assert from_root.issuer == pki.root.subject
    assert _ext(from_root, x509.AuthorityKeyIdentifier).value.key_identifier == _ski(pki.root)
    from_root.verify_directly_issued_by(pki.root)
