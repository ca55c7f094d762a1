from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from certs import (
    LeafTemplate,
    PemError,
    SpiffeId,
    cert_to_pem,
    certs_to_der,
    certs_to_pem,
    der_to_pem,
    load_cert,
    load_certs,
    load_der_certs,
)
from tests.support import mangled_certs
from tests.support.pki_views import Pki, make_leaf


def test_cert_to_pem_round_trip(pki: Pki) -> None:
    pem = cert_to_pem(pki.root)
    assert pem.startswith("-----BEGIN CERTIFICATE-----\n")
    assert pem.endswith("-----END CERTIFICATE-----\n")
    assert load_cert(pem) == pki.root
    assert load_cert(pem.encode()) == pki.root


def test_bundle_round_trip_keeps_order(pki: Pki, other_pki: Pki) -> None:
    certs = [pki.intermediate, pki.root, other_pki.root]
    bundle = certs_to_pem(certs)
    assert bundle.count("-----BEGIN CERTIFICATE-----") == 3
    assert bundle == "".join(cert_to_pem(c) for c in certs)
    assert load_certs(bundle) == certs
    assert load_cert(bundle) == pki.intermediate


def test_empty_bundle_is_empty_text() -> None:
    assert certs_to_pem([]) == ""


def test_bundle_tolerates_text_between_blocks(pki: Pki) -> None:
    bundle = "# roots\n" + cert_to_pem(pki.root) + "\nsome comment\n" + cert_to_pem(pki.root)
    assert load_certs(bundle) == [pki.root, pki.root]


@pytest.mark.parametrize(
    "data",
    [b"", "", "hello", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"],
)
def test_no_certificate_block(data: bytes | str) -> None:
    with pytest.raises(PemError, match=r"root-cert\.pem: no PEM CERTIFICATE block found"):
        load_certs(data, what="root-cert.pem")


def test_malformed_certificate_block() -> None:
    data = "-----BEGIN CERTIFICATE-----\nZm9vYmFy\n-----END CERTIFICATE-----\n"
    with pytest.raises(PemError, match=r"ca-cert\.pem: malformed PEM certificate"):
        load_cert(data, what="ca-cert.pem")


def test_pem_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        load_cert("nope")


def test_concatenated_der_round_trip_keeps_order(pki: Pki, other_pki: Pki) -> None:
    certs = [pki.intermediate, pki.root, other_pki.root]
    blob = certs_to_der(certs)
    assert load_der_certs(blob) == certs
    assert load_der_certs(certs_to_der([pki.root])) == [pki.root]


@pytest.mark.parametrize(
    "mangle",
    [
        lambda blob: b"",
        lambda blob: blob[:-1],  # cut short
        lambda blob: blob + b"\x30",  # a trailing byte that starts nothing
        lambda blob: b"\x04" + blob[1:],  # not a SEQUENCE
        lambda blob: blob[:1] + b"\x80" + blob[2:],  # indefinite length: not DER
        lambda blob: blob[:1] + b"\x89" + blob[2:],  # a 9-byte length
    ],
)
def test_bad_concatenated_der_is_a_pem_error(pki: Pki, mangle: Callable[[bytes], bytes]) -> None:
    with pytest.raises(PemError, match="bundle: "):
        load_der_certs(mangle(certs_to_der([pki.root, pki.root])), what="bundle")


def test_der_to_pem_is_the_text_cert_to_pem_gives(pki: Pki) -> None:
    """DER lengths of every residue modulo 48 (48 octets make one base64 line). An ECDSA
    signature's length varies (70-72 octets for P-256), so leaves are signed until every
    residue has one, not for a fixed list of identity lengths that may miss one."""
    template = LeafTemplate.for_issuer(pki.intermediate, pki.intermediate_key)
    now = datetime.now(UTC)
    certs = [pki.root, pki.intermediate]
    residues = {len(cert.public_bytes(Encoding.DER)) % 48 for cert in certs}
    for attempt in range(5000):  # 183 needed in a median run, 389 at most in 300 runs
        if len(residues) == 48:
            break
        der = template.sign(
            pki.leaf_key.public_key(),
            SpiffeId("cluster.local", "default", "s" * (1 + attempt % 150)),
            not_before=now,
            not_after=now + timedelta(hours=1),
        )
        if len(der) % 48 not in residues:
            residues.add(len(der) % 48)
            certs.append(x509.load_der_x509_certificate(der))
    assert len(residues) == 48, sorted(residues)
    for cert in certs:
        assert der_to_pem(cert.public_bytes(Encoding.DER)) == cert_to_pem(cert)


def test_a_certificate_whose_extensions_do_not_parse_is_refused_at_load(pki: Pki) -> None:
    """cryptography parses extensions on first use; load_certs parses them at once, so no
    malformed SAN surfaces later as a bare ValueError in whatever reads it first."""
    pem = mangled_certs.malformed_san_pem(make_leaf(pki))
    x509.load_pem_x509_certificate(pem.encode())  # loads, lazily
    with pytest.raises(PemError, match="malformed PEM certificate"):
        load_certs(pem)
    der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(Encoding.DER)
    with pytest.raises(PemError, match="malformed DER certificate"):
        load_der_certs(der)
