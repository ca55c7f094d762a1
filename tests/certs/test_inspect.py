from __future__ import annotations

from datetime import timedelta

import pytest
from cryptography import x509

from certs import (
    PemError,
    build_serving_certificate,
    describe_certificate,
    format_duration,
)
from tests.support import mangled_certs
from tests.support.pki_views import IDENTITY, NOW, Pki, make_leaf


def test_describe_workload_leaf(pki: Pki) -> None:
    leaf = make_leaf(
        pki, not_before=NOW - timedelta(minutes=2), not_after=NOW + timedelta(hours=24)
    )
    info = describe_certificate(leaf)
    assert info.subject == ""
    assert info.issuer == pki.intermediate.subject.rfc4514_string()
    assert info.serial == leaf.serial_number
    assert info.serial_hex == format(leaf.serial_number, "x")
    assert int(info.serial_hex, 16) == leaf.serial_number
    assert info.uri_sans == (IDENTITY.uri,)
    assert info.dns_sans == ()
    assert info.identity == IDENTITY.uri
    assert info.not_before == NOW - timedelta(minutes=2)
    assert info.not_after == NOW + timedelta(hours=24)
    assert info.lifetime == timedelta(hours=24, minutes=2)
    assert info.time_left(NOW) == timedelta(hours=24)
    assert info.time_left(NOW + timedelta(days=2)) == -timedelta(hours=24)
    assert not info.is_ca


def test_describe_root_has_no_identity(pki: Pki) -> None:
    info = describe_certificate(pki.root)
    assert info.is_ca
    assert info.uri_sans == ()
    assert info.identity is None
    assert "O=cluster.local" in info.subject
    assert info.subject == info.issuer


def test_describe_serving_certificate(pki: Pki) -> None:
    cert = build_serving_certificate(
        pki.leaf_key.public_key(),
        pki.root,
        pki.root_key,
        hosts=["ca.example", "127.0.0.1"],
        now=NOW,
        lifetime=timedelta(days=1),
    )
    info = describe_certificate(cert)
    assert info.dns_sans == ("ca.example",)
    assert info.uri_sans == ()
    assert info.identity is None


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(seconds=59), "59s"),
        (timedelta(minutes=59, seconds=12), "59m12s"),
        (timedelta(hours=1), "1h"),
        (timedelta(days=3, hours=4), "3d4h"),
        (timedelta(days=1, seconds=1), "1d1s"),
        (timedelta(days=90), "90d"),
        (timedelta(days=1, hours=2, minutes=3, seconds=4), "1d2h3m4s"),
        (timedelta(hours=-2), "-2h"),
        (timedelta(seconds=-90), "-1m30s"),
        (timedelta(seconds=5, milliseconds=900), "5s"),
        (timedelta(milliseconds=300), "0s"),
    ],
)
def test_format_duration(delta: timedelta, text: str) -> None:
    assert format_duration(delta) == text


def test_a_certificate_whose_extensions_do_not_parse_is_a_pem_error(pki: Pki) -> None:
    lazy = x509.load_pem_x509_certificate(mangled_certs.malformed_san_pem(make_leaf(pki)).encode())
    with pytest.raises(PemError, match="do not parse"):
        describe_certificate(lazy)
