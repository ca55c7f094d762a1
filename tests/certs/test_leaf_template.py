"""The DER leaf template against its reference, `CertificateBuilder` (`WorkloadLeafProfile`).

For every issuer and leaf key type meshca signs with, serials around every length boundary,
validities on both sides of 2050 and identities of every legal length, the template's
TBSCertificate is byte for byte the builder's (for RSA issuers the whole certificate is: PKCS#1
v1.5 is deterministic), and the `openssl verify` command accepts the result against the chain.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from functools import cache
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from certs import (
    KeyMaterialError,
    KeySpec,
    PrivateKey,
    SpiffeId,
    build_csr,
    build_intermediate_certificate,
    build_root_certificate,
    cert_to_pem,
    generate_private_key,
    load_csr,
    make_authority,
)
from certs.leaf_template import LeafTemplate, der_serial, der_time, subject_public_key_info
from certs.profile import WorkloadLeafProfile
from tests.support.hostile_csr import compressed_point

KEY_SPECS = ("ec-p256", "ec-p384", "rsa-2048", "rsa-3072", "rsa-4096")
# Issuers valid 2000-2100, so leaves on both sides of 2050 verify at a time inside them.
ISSUED_AT = datetime(2000, 1, 1, tzinfo=UTC)
ISSUER_LIFETIME = timedelta(days=365 * 100)
SERIALS = (1, 127, 128, 255, 256, 2**126 + 5, 2**158 + 3, 2**159 - 1)
BOUNDARY = datetime(2050, 1, 1, tzinfo=UTC)
LONGEST_IDENTITY = SpiffeId("t" * 255, "n" * 63, "s" * 253)


@dataclass(frozen=True)
class Issuer:
    """A root (P-256) and, under it, the issuing CA of one key type."""

    root: x509.Certificate
    cert: x509.Certificate
    key: PrivateKey


@cache
def root() -> tuple[x509.Certificate, PrivateKey]:
    key = generate_private_key()
    cert = build_root_certificate(key, "cluster.local", now=ISSUED_AT, lifetime=ISSUER_LIFETIME)
    return cert, key


@cache
def issuer(spec: str) -> Issuer:
    root_cert, root_key = root()
    key = generate_private_key(KeySpec.parse(spec))
    cert = build_intermediate_certificate(
        key.public_key(),
        root_cert,
        root_key,
        "cluster.local",
        now=ISSUED_AT + timedelta(minutes=5),
        lifetime=ISSUER_LIFETIME,
    )
    return Issuer(root_cert, cert, key)


@cache
def leaf_csr(spec: str) -> x509.CertificateSigningRequest:
    """One verified CSR per leaf key type (the template reads only its key from it)."""
    key = generate_private_key(KeySpec.parse(spec))
    return load_csr(build_csr(key, SpiffeId("cluster.local", "default", "sleep")))


def template_of(spec: str) -> tuple[Issuer, WorkloadLeafProfile, LeafTemplate]:
    chosen = issuer(spec)
    profile = WorkloadLeafProfile.for_issuer(chosen.cert, chosen.key)
    return chosen, profile, LeafTemplate.from_profile(profile)


identities = st.builds(
    SpiffeId,
    st.from_regex(r"[a-z0-9._-]{1,255}", fullmatch=True),
    st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True),
    st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", fullmatch=True),
)
serials = st.one_of(
    st.sampled_from(SERIALS),
    st.integers(2**158, 2**159 - 1),  # random 159-bit
    st.integers(1, 2**159 - 1),
)
zones = st.one_of(
    st.just(UTC),
    st.none(),  # naive: taken as UTC, as the builder does
    st.builds(timezone, st.timedeltas(timedelta(hours=-23), timedelta(hours=23))),
)


def around(moment: datetime) -> st.SearchStrategy[datetime]:
    return st.sampled_from(
        (moment, moment - timedelta(seconds=1), moment + timedelta(seconds=1, microseconds=999))
    )


def moments(earliest: datetime, latest: datetime) -> st.SearchStrategy[datetime]:
    """Times between the two, in UTC, naive or another zone, with the 2050 boundary favoured."""
    naive = st.one_of(
        around(BOUNDARY.replace(tzinfo=None)),
        st.datetimes(earliest.replace(tzinfo=None), latest.replace(tzinfo=None)),
    )
    return st.builds(
        lambda moment, zone: moment.replace(tzinfo=UTC).astimezone(zone) if zone else moment,
        naive,
        zones,
    )


@st.composite
def validities(draw: st.DrawFn, earliest: datetime, latest: datetime) -> tuple[datetime, datetime]:
    first, second = draw(moments(earliest, latest)), draw(moments(earliest, latest))
    as_utc = [m if m.tzinfo else m.replace(tzinfo=UTC) for m in (first, second)]
    return (first, second) if as_utc[0] <= as_utc[1] else (second, first)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    issuer_spec=st.sampled_from(KEY_SPECS),
    leaf_spec=st.sampled_from(KEY_SPECS),
    serial=serials,
    validity=validities(datetime(1950, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, tzinfo=UTC)),
    identity=identities,
    with_csr=st.booleans(),
)
@example(
    "ec-p256", "ec-p256", 128, (BOUNDARY - timedelta(seconds=1), BOUNDARY), LONGEST_IDENTITY, True
)
@example("rsa-4096", "rsa-4096", 2**158 + 3, (BOUNDARY, BOUNDARY), LONGEST_IDENTITY, False)
@example("ec-p384", "rsa-3072", 1, (datetime(1950, 1, 1), datetime(9999, 12, 31, 23, 59, 59)),
         SpiffeId("a", "b", "c"), True)  # fmt: skip
def test_tbs_is_byte_identical_to_the_builders(
    issuer_spec: str,
    leaf_spec: str,
    serial: int,
    validity: tuple[datetime, datetime],
    identity: SpiffeId,
    with_csr: bool,
) -> None:
    chosen, profile, template = template_of(issuer_spec)
    csr = leaf_csr(leaf_spec)
    public_key = csr.public_key()
    not_before, not_after = validity
    reference = profile.build(
        public_key,  # type: ignore[arg-type]
        identity,
        not_before=not_before,
        not_after=not_after,
        serial=serial,
    )
    der = template.sign(
        public_key,  # type: ignore[arg-type]
        identity,
        not_before=not_before,
        not_after=not_after,
        serial=serial,
        csr=csr if with_csr else None,
    )
    leaf = x509.load_der_x509_certificate(der)
    assert leaf.tbs_certificate_bytes == reference.tbs_certificate_bytes
    if issuer_spec.startswith("rsa"):
        assert der == reference.public_bytes(serialization.Encoding.DER)
    assert leaf.signature_algorithm_oid == reference.signature_algorithm_oid
    leaf.verify_directly_issued_by(chosen.cert)


def openssl_verify(tmp: Path, issuing: Issuer, leaf_der: bytes, at: datetime) -> str:
    """`openssl verify` (the real command) of the leaf against root + issuing CA at `at`."""
    (tmp / "root.pem").write_text(cert_to_pem(issuing.root))
    (tmp / "issuing.pem").write_text(cert_to_pem(issuing.cert))
    (tmp / "leaf.pem").write_text(cert_to_pem(x509.load_der_x509_certificate(leaf_der)))
    done = subprocess.run(
        [
            "openssl",
            "verify",
            "-x509_strict",
            "-purpose",
            "sslclient",
            "-attime",
            str(int(at.timestamp())),
            "-CAfile",
            str(tmp / "root.pem"),
            "-untrusted",
            str(tmp / "issuing.pem"),
            str(tmp / "leaf.pem"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return f"rc={done.returncode} {done.stdout.strip()} {done.stderr.strip()}"


@pytest.mark.process
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    issuer_spec=st.sampled_from(KEY_SPECS),
    leaf_spec=st.sampled_from(KEY_SPECS),
    serial=serials,
    validity=validities(ISSUED_AT + timedelta(hours=1), datetime(2099, 1, 1, tzinfo=UTC)),
    identity=identities,
)
@example("ec-p256", "ec-p256", 256, (BOUNDARY - timedelta(hours=1), BOUNDARY), LONGEST_IDENTITY)
@example("rsa-2048", "ec-p384", 255, (BOUNDARY, BOUNDARY + timedelta(days=1)), LONGEST_IDENTITY)
def test_openssl_verify_accepts_the_template_leaf(
    tmp_path: Path,
    issuer_spec: str,
    leaf_spec: str,
    serial: int,
    validity: tuple[datetime, datetime],
    identity: SpiffeId,
) -> None:
    chosen, _, template = template_of(issuer_spec)
    csr = leaf_csr(leaf_spec)
    not_before, not_after = validity[0], validity[1] + timedelta(seconds=2)  # a time inside
    der = template.sign(
        csr.public_key(),  # type: ignore[arg-type]
        identity,
        not_before=not_before,
        not_after=not_after,
        serial=serial,
        csr=csr,
    )
    leaf = x509.load_der_x509_certificate(der)
    start, end = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    result = openssl_verify(tmp_path, chosen, der, start + (end - start) / 2)
    assert result.startswith("rc=0 ") and ": OK" in result, result
    # and the same leaf, checked after it expired, is refused: the check can fail
    expired = openssl_verify(tmp_path, chosen, der, end + timedelta(seconds=2))
    assert not expired.startswith("rc=0 "), expired


def test_serials_are_minimal_der_integers() -> None:
    assert der_serial(1) == bytes.fromhex("020101")
    assert der_serial(127) == bytes.fromhex("02017f")
    assert der_serial(128) == bytes.fromhex("02020080")
    assert der_serial(255) == bytes.fromhex("020200ff")
    assert der_serial(256) == bytes.fromhex("02020100")
    assert der_serial(2**126 + 5)[:3] == bytes.fromhex("021040")  # 16 octets, no zero
    assert der_serial(2**159 - 1)[:3] == bytes.fromhex("02147f")  # the largest: 20 octets
    for refused in (0, -1, 2**159):
        with pytest.raises(ValueError, match="serial number"):
            der_serial(refused)


def test_times_switch_to_generalized_time_at_2050() -> None:
    assert der_time(BOUNDARY - timedelta(seconds=1)) == b"\x17\x0d491231235959Z"
    assert der_time(BOUNDARY) == b"\x18\x0f20500101000000Z"
    assert der_time(datetime(2050, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=1)))) == (
        b"\x18\x0f20500101000000Z"
    )
    with pytest.raises(ValueError, match="1950"):
        der_time(datetime(1949, 12, 31, 23, 59, 59))


def test_the_template_refuses_what_the_builder_refuses() -> None:
    _, profile, template = template_of("ec-p256")
    public_key = leaf_csr("ec-p256").public_key()
    now = datetime(2030, 1, 1, tzinfo=UTC)
    for build in (profile.build, template.sign):
        with pytest.raises(ValueError, match="not valid after date must be after"):
            build(public_key, LONGEST_IDENTITY, not_before=now, not_after=now - timedelta(1))  # type: ignore[arg-type]


def test_a_random_serial_is_what_random_serial_gives() -> None:
    """No serial: 127 random bits with the top one set, as `random_serial` (the builder's)."""
    _, _, template = template_of("ec-p256")
    public_key = leaf_csr("ec-p256").public_key()
    now = datetime(2030, 1, 1, tzinfo=UTC)
    serials = {
        x509.load_der_x509_certificate(
            template.sign(public_key, LONGEST_IDENTITY, not_before=now, not_after=now)  # type: ignore[arg-type]
        ).serial_number
        for _ in range(20)
    }
    assert len(serials) == 20
    assert all(serial.bit_length() == 127 for serial in serials)


# -- the key's shape ---------------------------------------------------------------------------


def test_a_compressed_point_is_re_encoded_uncompressed() -> None:
    """The CSR's SPKI is sliced only in its canonical shape; a compressed point is re-encoded
    by cryptography, so the leaf is the builder's (named curve, uncompressed point)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = load_csr(compressed_point(key, LONGEST_IDENTITY))
    public = csr.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    spki = subject_public_key_info(public, csr)
    canonical = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert spki == canonical
    assert spki[26] == 0x04 and len(spki) == 91
    _, profile, template = template_of("ec-p256")
    now = datetime(2030, 1, 1, tzinfo=UTC)
    leaf = x509.load_der_x509_certificate(
        template.sign(public, LONGEST_IDENTITY, not_before=now, not_after=now, serial=9, csr=csr)
    )
    reference = profile.build(public, LONGEST_IDENTITY, not_before=now, not_after=now, serial=9)
    assert leaf.tbs_certificate_bytes == reference.tbs_certificate_bytes


def test_an_odd_rsa_exponent_is_kept_as_the_builder_keeps_it() -> None:
    key = rsa.generate_private_key(public_exponent=3, key_size=2048)
    csr = load_csr(build_csr(key, LONGEST_IDENTITY))
    public = csr.public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    _, profile, template = template_of("rsa-2048")
    now = datetime(2030, 1, 1, tzinfo=UTC)
    der = template.sign(public, LONGEST_IDENTITY, not_before=now, not_after=now, serial=3, csr=csr)
    reference = profile.build(public, LONGEST_IDENTITY, not_before=now, not_after=now, serial=3)
    assert der == reference.public_bytes(serialization.Encoding.DER)
    leaf_key = x509.load_der_x509_certificate(der).public_key()
    assert isinstance(leaf_key, rsa.RSAPublicKey) and leaf_key.public_numbers().e == 3


@pytest.mark.parametrize(
    ("make_key", "fragment"),
    [
        (lambda: ed25519.Ed25519PrivateKey.generate().public_key(), "not supported"),
        (lambda: ec.generate_private_key(ec.SECP521R1()).public_key(), "secp521r1"),
        (lambda: ec.generate_private_key(ec.SECP256K1()).public_key(), "secp256k1"),
        (lambda: rsa.generate_private_key(65537, 1024).public_key(), "RSA-1024"),
    ],
    ids=["ed25519", "p521", "secp256k1", "rsa-1024"],
)
def test_keys_outside_the_policy_are_refused(make_key: object, fragment: str) -> None:
    """What `ca_server.authz` refuses before signing, refused again where the key is encoded."""
    _, _, template = template_of("ec-p256")
    now = datetime(2030, 1, 1, tzinfo=UTC)
    with pytest.raises(KeyMaterialError, match=fragment):
        template.sign(make_key(), LONGEST_IDENTITY, not_before=now, not_after=now)  # type: ignore[operator]


def test_the_authority_derives_its_template_once() -> None:
    chosen = issuer("ec-p256")
    authority = make_authority(chosen.cert, chosen.key, [], [chosen.root])
    assert authority.leaf_template is authority.leaf_template
    csr = leaf_csr("ec-p384")
    now = datetime(2030, 1, 1, tzinfo=UTC)
    serial = secrets.randbits(100) + 1
    der = authority.leaf_template.sign(
        csr.public_key(),  # type: ignore[arg-type]
        LONGEST_IDENTITY,
        not_before=now,
        not_after=now,
        serial=serial,
        csr=csr,
    )
    reference = authority.leaf_profile.build(
        csr.public_key(),  # type: ignore[arg-type]
        LONGEST_IDENTITY,
        not_before=now,
        not_after=now,
        serial=serial,
    )
    assert x509.load_der_x509_certificate(der).tbs_certificate_bytes == (
        reference.tbs_certificate_bytes
    )
