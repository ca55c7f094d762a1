from __future__ import annotations

from datetime import timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from certs import (
    ChainError,
    build_intermediate_certificate,
    build_root_certificate,
    is_ca,
    verify_chain,
)
from tests.support import mangled_certs
from tests.support.pki_views import NOW, TRUST_DOMAIN, Pki, make_leaf


def test_root_to_leaf(pki: Pki) -> None:
    leaf = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
    assert verify_chain([leaf], [pki.root], now=NOW) == pki.root


def test_root_to_intermediate_to_leaf(pki: Pki) -> None:
    leaf = make_leaf(pki)
    assert verify_chain([leaf, pki.intermediate], [pki.root], now=NOW) == pki.root


def test_chain_may_end_with_the_root_itself(pki: Pki) -> None:
    leaf = make_leaf(pki)
    assert verify_chain([leaf, pki.intermediate, pki.root], [pki.root], now=NOW) == pki.root


def test_picks_the_matching_root_from_a_bundle(pki: Pki, other_pki: Pki) -> None:
    leaf = make_leaf(pki)
    roots = [other_pki.root, pki.root]
    assert verify_chain([leaf, pki.intermediate], roots, now=NOW) == pki.root


def test_validity_bounds_are_inclusive(pki: Pki) -> None:
    not_before = NOW - timedelta(minutes=2)
    not_after = NOW + timedelta(hours=1)
    leaf = make_leaf(pki, not_before=not_before, not_after=not_after)
    verify_chain([leaf, pki.intermediate], [pki.root], now=not_before)
    verify_chain([leaf, pki.intermediate], [pki.root], now=not_after)


def test_rejects_wrong_root(pki: Pki, other_pki: Pki) -> None:
    """Same subject names, different keys: the signature decides."""
    leaf = make_leaf(pki)
    assert other_pki.root.subject == pki.root.subject
    with pytest.raises(ChainError, match="does not lead to any trusted root"):
        verify_chain([leaf, pki.intermediate], [other_pki.root], now=NOW)


def test_rejects_expired_leaf(pki: Pki) -> None:
    leaf = make_leaf(pki, not_after=NOW + timedelta(hours=1))
    with pytest.raises(ChainError, match="leaf certificate expired"):
        verify_chain([leaf, pki.intermediate], [pki.root], now=NOW + timedelta(hours=1, seconds=1))


def test_rejects_not_yet_valid_leaf(pki: Pki) -> None:
    leaf = make_leaf(pki, not_before=NOW + timedelta(minutes=5))
    with pytest.raises(ChainError, match="leaf certificate is not valid until"):
        verify_chain([leaf, pki.intermediate], [pki.root], now=NOW)


def test_rejects_expired_intermediate(pki: Pki) -> None:
    intermediate = build_intermediate_certificate(
        pki.intermediate_key.public_key(),
        pki.root,
        pki.root_key,
        TRUST_DOMAIN,
        now=NOW - timedelta(days=10),
        lifetime=timedelta(days=1),
    )
    leaf = make_leaf(pki, issuer=intermediate, not_after=NOW + timedelta(days=1))
    with pytest.raises(ChainError, match="intermediate #1 expired"):
        verify_chain([leaf, intermediate], [pki.root], now=NOW)


def test_rejects_expired_root(pki: Pki) -> None:
    old_root = build_root_certificate(
        pki.root_key, TRUST_DOMAIN, now=NOW - timedelta(days=10), lifetime=timedelta(days=1)
    )
    leaf = make_leaf(pki, issuer=old_root, issuer_key=pki.root_key)
    with pytest.raises(ChainError, match="root certificate expired"):
        verify_chain([leaf], [old_root], now=NOW)


def test_rejects_broken_link_order(pki: Pki) -> None:
    leaf = make_leaf(pki)
    with pytest.raises(ChainError):
        verify_chain([pki.intermediate, leaf], [pki.root], now=NOW)


def test_rejects_missing_intermediate(pki: Pki) -> None:
    leaf = make_leaf(pki)
    with pytest.raises(ChainError, match="does not lead to any trusted root"):
        verify_chain([leaf], [pki.root], now=NOW)


def test_rejects_link_signed_by_someone_else(pki: Pki, other_pki: Pki) -> None:
    leaf = make_leaf(
        other_pki, issuer=other_pki.intermediate, issuer_key=other_pki.intermediate_key
    )
    assert other_pki.intermediate.subject == pki.intermediate.subject
    with pytest.raises(ChainError, match="leaf certificate was not signed by the next"):
        verify_chain([leaf, pki.intermediate], [pki.root], now=NOW)


def test_rejects_non_ca_intermediate(pki: Pki) -> None:
    """A workload leaf (CA:false) must not be usable to sign another leaf."""
    workload = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
    forged = make_leaf(pki, issuer=workload, issuer_key=pki.leaf_key)
    forged.verify_directly_issued_by(workload)  # the signature itself is fine
    with pytest.raises(ChainError, match="intermediate #1 is not a CA"):
        verify_chain([forged, workload], [pki.root], now=NOW)


def test_rejects_non_ca_root(pki: Pki) -> None:
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "not a ca")])
    fake_root = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pki.root_key.public_key())
        .serial_number(1)
        .not_valid_before(NOW - timedelta(days=1))
        .not_valid_after(NOW + timedelta(days=1))
        .sign(pki.root_key, hashes.SHA256())
    )
    assert not is_ca(fake_root)  # no BasicConstraints at all
    leaf = make_leaf(pki, issuer=fake_root, issuer_key=pki.root_key)
    with pytest.raises(ChainError, match="root is not a CA"):
        verify_chain([leaf], [fake_root], now=NOW)


def test_rejects_empty_chain(pki: Pki) -> None:
    with pytest.raises(ChainError, match="empty certificate chain"):
        verify_chain([], [pki.root], now=NOW)


def test_rejects_empty_roots(pki: Pki) -> None:
    with pytest.raises(ChainError, match="no trusted roots"):
        verify_chain([make_leaf(pki)], [], now=NOW)


def test_is_ca(pki: Pki) -> None:
    assert is_ca(pki.root)
    assert is_ca(pki.intermediate)
    assert not is_ca(make_leaf(pki))


def test_an_issuer_of_an_unknown_key_algorithm_signed_nothing(pki: Pki) -> None:
    """Its UnsupportedAlgorithm (no ValueError) is a broken link, not an escaping exception."""
    leaf = make_leaf(pki)
    assert verify_chain([leaf, pki.intermediate], [pki.root], now=NOW) == pki.root
    strange_root = mangled_certs.unknown_key_algorithm(pki.root)
    with pytest.raises(ChainError, match="does not lead to any trusted root"):
        verify_chain([leaf, pki.intermediate], [strange_root], now=NOW)
    strange_intermediate = mangled_certs.unknown_key_algorithm(pki.intermediate)
    with pytest.raises(ChainError, match="not signed by the next"):
        verify_chain([leaf, strange_intermediate], [pki.root], now=NOW)
