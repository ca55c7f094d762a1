"""`certs.build_path`: the path from a peer's leaf to a trusted root, through the certificates it
presented after the leaf taken as candidates (what Istio's agent sends over mTLS: its
`cert-chain.pem`, the leaf then intermediates then its whole root bundle)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from certs import (
    ChainError,
    ChainOrderError,
    ForeignCertificateError,
    build_intermediate_certificate,
    build_path,
    generate_private_key,
)
from tests.support.pki_views import NOW, TRUST_DOMAIN, Pki, make_leaf, make_pki


def test_leaf_alone_under_a_root(pki: Pki) -> None:
    leaf = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
    assert build_path(leaf, [], [pki.root], now=NOW) == (leaf, pki.root)


def test_leaf_intermediate_and_root(pki: Pki) -> None:
    leaf = make_leaf(pki)
    path = build_path(leaf, [pki.intermediate, pki.root], [pki.root], now=NOW)
    assert path == (leaf, pki.intermediate, pki.root)


def test_two_roots_after_the_leaf_during_an_overlap(pki: Pki, other_pki: Pki) -> None:
    """No certificate signs the next one, yet the bundle is what Istio appends."""
    leaf = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
    roots = [other_pki.root, pki.root]
    for presented in ([pki.root, other_pki.root], [other_pki.root, pki.root]):
        assert build_path(leaf, presented, roots, now=NOW) == (leaf, pki.root)


def test_an_untrusted_root_may_ride_along_unused(pki: Pki, other_pki: Pki) -> None:
    """A bundle written before the CA dropped a root still renews."""
    leaf = make_leaf(pki)
    presented = [pki.intermediate, other_pki.root, pki.root]
    assert build_path(leaf, presented, [pki.root], now=NOW)[-1] == pki.root


def test_a_repeat_of_the_leaf_is_ignored(pki: Pki) -> None:
    leaf = make_leaf(pki)
    assert build_path(leaf, [leaf, pki.intermediate], [pki.root], now=NOW)[-1] == pki.root


def test_two_intermediates_in_order_and_out_of_order(pki: Pki) -> None:
    top_key = generate_private_key()
    top = build_intermediate_certificate(
        top_key.public_key(), pki.root, pki.root_key, TRUST_DOMAIN, now=NOW,
        lifetime=timedelta(days=30), common_name="top", path_length=1,
    )  # fmt: skip
    bottom_key = generate_private_key()
    bottom = build_intermediate_certificate(
        bottom_key.public_key(), top, top_key, TRUST_DOMAIN, now=NOW,
        lifetime=timedelta(days=30), common_name="bottom",
    )  # fmt: skip
    leaf = make_leaf(pki, issuer=bottom, issuer_key=bottom_key)
    assert build_path(leaf, [bottom, top], [pki.root], now=NOW) == (leaf, bottom, top, pki.root)
    with pytest.raises(ChainOrderError, match=r"certificate #3 \(CN=bottom.*comes before it"):
        build_path(leaf, [top, bottom], [pki.root], now=NOW)


def test_a_root_before_the_intermediate_is_out_of_order(pki: Pki) -> None:
    leaf = make_leaf(pki)
    with pytest.raises(ChainOrderError, match="list the intermediates first, then the roots"):
        build_path(leaf, [pki.root, pki.intermediate], [pki.root], now=NOW)


def test_a_ca_certificate_in_the_leaf_position(pki: Pki) -> None:
    with pytest.raises(ChainOrderError, match="must come first"):
        build_path(pki.intermediate, [make_leaf(pki)], [pki.root], now=NOW)


def test_a_foreign_intermediate_is_refused(pki: Pki, other_pki: Pki) -> None:
    leaf = make_leaf(pki)
    presented = [pki.intermediate, other_pki.intermediate, pki.root]
    with pytest.raises(ForeignCertificateError, match=r"certificate #3 .*remove it"):
        build_path(leaf, presented, [pki.root], now=NOW)


def test_a_leaf_of_a_foreign_intermediate_is_refused(pki: Pki, other_pki: Pki) -> None:
    leaf = make_leaf(pki, issuer=other_pki.intermediate, issuer_key=other_pki.intermediate_key)
    with pytest.raises(ChainError, match="a root this CA does not trust"):
        build_path(leaf, [other_pki.intermediate, other_pki.root], [pki.root], now=NOW)
    with pytest.raises(ChainError, match="neither a root this CA trusts nor any certificate"):
        build_path(leaf, [pki.intermediate], [pki.root], now=NOW)


def test_another_leaf_after_the_leaf_is_refused(pki: Pki) -> None:
    leaf = make_leaf(pki)
    other = make_leaf(pki, not_after=NOW + timedelta(hours=2))
    with pytest.raises(ForeignCertificateError, match="not a CA certificate"):
        build_path(leaf, [pki.intermediate, other], [pki.root], now=NOW)


def test_expired_intermediate_and_path_length(pki: Pki) -> None:
    later = NOW + timedelta(days=400)  # past the intermediate's year, within the root's
    leaf = make_leaf(pki, not_before=later - timedelta(minutes=2), not_after=later + timedelta(1))
    with pytest.raises(ChainError, match=r"certificate #2 .* expired"):
        build_path(leaf, [pki.intermediate], [pki.root], now=later)
    # The intermediate allows no CA below it: one more level under it breaks the constraint.
    lower_key = generate_private_key()
    lower = build_intermediate_certificate(
        lower_key.public_key(), pki.intermediate, pki.intermediate_key, TRUST_DOMAIN, now=NOW,
        lifetime=timedelta(days=30), common_name="lower",
    )  # fmt: skip
    deep = make_leaf(pki, issuer=lower, issuer_key=lower_key)
    assert build_path(make_leaf(pki), [pki.intermediate], [pki.root], now=NOW)
    with pytest.raises(ChainError, match="allows 0 intermediate"):
        build_path(deep, [lower, pki.intermediate], [pki.root], now=NOW)


def test_no_roots(pki: Pki) -> None:
    with pytest.raises(ChainError, match="no trusted roots"):
        build_path(make_leaf(pki), [pki.intermediate], [], now=NOW)


def test_each_call_builds_its_own_pki() -> None:
    """The fixtures give distinct PKIs (the foreign cases depend on it)."""
    assert make_pki().root != make_pki().root


def test_a_cross_signed_twin_of_the_root_may_ride_along(pki: Pki, other_pki: Pki) -> None:
    """During a cross-signed root change the client may send the new root signed by the old
    one; a CA already trusting the new root finds the path without it."""
    twin = build_intermediate_certificate(
        pki.root_key.public_key(), other_pki.root, other_pki.root_key, TRUST_DOMAIN, now=NOW,
        lifetime=timedelta(days=30), common_name="meshca root", path_length=1,
    )  # fmt: skip
    leaf = make_leaf(pki)
    assert build_path(leaf, [pki.intermediate, twin], [pki.root], now=NOW)[-1] == pki.root
    # A CA trusting only the old root goes through the twin.
    path = build_path(leaf, [pki.intermediate, twin], [other_pki.root], now=NOW)
    assert path == (leaf, pki.intermediate, twin, other_pki.root)


def test_a_long_list_is_refused_before_any_check(pki: Pki) -> None:
    leaf = make_leaf(pki)
    with pytest.raises(ChainError, match="17 certificates follow the leaf, at most 16"):
        build_path(leaf, [pki.intermediate] * 17, [pki.root], now=NOW)
