from __future__ import annotations

from datetime import timedelta

import pytest
from cryptography import x509

from certs import (
    ChainError,
    KeyMaterialError,
    SigningAuthority,
    build_intermediate_certificate,
    build_root_certificate,
    cert_to_pem,
    certs_to_pem,
    generate_private_key,
    load_certs,
    make_authority,
)
from tests.support.pki_views import NOW, TRUST_DOMAIN, Pki, make_leaf


def _self_signed(pki: Pki, *extra_roots: x509.Certificate) -> SigningAuthority:
    return SigningAuthority(
        cert=pki.root, key=pki.root_key, intermediates=(), roots=(pki.root, *extra_roots)
    )


def _plugged_in(pki: Pki) -> SigningAuthority:
    return SigningAuthority(
        cert=pki.intermediate, key=pki.intermediate_key, intermediates=(), roots=(pki.root,)
    )


def _two_level(pki: Pki) -> tuple[SigningAuthority, x509.Certificate]:
    """root → intermediate → issuing CA; returns the authority and the middle certificate."""
    middle = build_intermediate_certificate(
        pki.intermediate_key.public_key(),
        pki.root,
        pki.root_key,
        TRUST_DOMAIN,
        now=NOW - timedelta(days=1),
        lifetime=timedelta(days=300),
        common_name="middle",
        path_length=None,
    )
    issuing_key = generate_private_key()
    issuing = build_intermediate_certificate(
        issuing_key.public_key(),
        middle,
        pki.intermediate_key,
        TRUST_DOMAIN,
        now=NOW - timedelta(days=1),
        lifetime=timedelta(days=200),
        common_name="issuing",
    )
    authority = SigningAuthority(
        cert=issuing, key=issuing_key, intermediates=(middle,), roots=(pki.root,)
    )
    return authority, middle


class TestValidate:
    def test_accepts_self_signed_root(self, pki: Pki) -> None:
        authority = _self_signed(pki)
        authority.validate(now=NOW)
        assert authority.is_self_signed_root

    def test_accepts_plugged_in_intermediate(self, pki: Pki) -> None:
        authority = _plugged_in(pki)
        authority.validate(now=NOW)
        assert not authority.is_self_signed_root

    def test_accepts_two_level_chain(self, pki: Pki) -> None:
        authority, _ = _two_level(pki)
        authority.validate(now=NOW)
        assert not authority.is_self_signed_root

    def test_rejects_key_mismatch(self, pki: Pki, other_pki: Pki) -> None:
        authority = SigningAuthority(
            cert=pki.intermediate,
            key=other_pki.intermediate_key,
            intermediates=(),
            roots=(pki.root,),
        )
        with pytest.raises(KeyMaterialError, match="does not match"):
            authority.validate(now=NOW)

    def test_rejects_non_ca_certificate(self, pki: Pki) -> None:
        leaf = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
        authority = SigningAuthority(
            cert=leaf, key=pki.leaf_key, intermediates=(), roots=(pki.root,)
        )
        with pytest.raises(ChainError, match="not a CA"):
            authority.validate(now=NOW)

    def test_rejects_cert_not_chaining_to_root(self, pki: Pki, other_pki: Pki) -> None:
        authority = SigningAuthority(
            cert=pki.intermediate,
            key=pki.intermediate_key,
            intermediates=(),
            roots=(other_pki.root,),
        )
        with pytest.raises(ChainError, match="does not chain to the root bundle"):
            authority.validate(now=NOW)

    def test_rejects_missing_middle_intermediate(self, pki: Pki) -> None:
        authority, _ = _two_level(pki)
        broken = SigningAuthority(
            cert=authority.cert, key=authority.key, intermediates=(), roots=authority.roots
        )
        with pytest.raises(ChainError, match="does not chain"):
            broken.validate(now=NOW)

    def test_rejects_expired_ca(self, pki: Pki) -> None:
        with pytest.raises(ChainError, match="expired"):
            _plugged_in(pki).validate(now=pki.intermediate.not_valid_after_utc + timedelta(1))


class TestResponseChain:
    def test_self_signed_is_leaf_then_roots(self, pki: Pki) -> None:
        leaf = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
        chain = _self_signed(pki).response_chain(leaf)
        assert chain == [cert_to_pem(leaf), cert_to_pem(pki.root)]

    def test_root_bundle_with_several_roots_is_one_last_element(
        self, pki: Pki, other_pki: Pki
    ) -> None:
        leaf = make_leaf(pki, issuer=pki.root, issuer_key=pki.root_key)
        authority = _self_signed(pki, other_pki.root)
        assert authority.is_self_signed_root
        chain = authority.response_chain(leaf)
        assert len(chain) == 2
        assert load_certs(chain[1]) == [pki.root, other_pki.root]
        assert chain[1] == authority.root_bundle_pem

    def test_intermediate_is_leaf_intermediate_roots(self, pki: Pki) -> None:
        leaf = make_leaf(pki)
        chain = _plugged_in(pki).response_chain(leaf)
        assert chain == [cert_to_pem(leaf), cert_to_pem(pki.intermediate), cert_to_pem(pki.root)]

    def test_each_intermediate_is_its_own_element(self, pki: Pki) -> None:
        authority, middle = _two_level(pki)
        leaf = make_leaf(pki, issuer=authority.cert, issuer_key=authority.key)
        chain = authority.response_chain(leaf)
        assert chain == [
            cert_to_pem(leaf),
            cert_to_pem(authority.cert),
            cert_to_pem(middle),
            cert_to_pem(pki.root),
        ]
        assert all(element.count("BEGIN CERTIFICATE") == 1 for element in chain)

    def test_root_listed_among_intermediates_appears_only_in_the_bundle(self, pki: Pki) -> None:
        authority = SigningAuthority(
            cert=pki.intermediate,
            key=pki.intermediate_key,
            intermediates=(pki.root,),
            roots=(pki.root,),
        )
        leaf = make_leaf(pki)
        assert authority.response_chain(leaf) == [
            cert_to_pem(leaf),
            cert_to_pem(pki.intermediate),
            cert_to_pem(pki.root),
        ]


class TestMakeAuthority:
    def test_dedupes_cert_and_root_from_cert_chain(self, pki: Pki) -> None:
        authority, middle = _two_level(pki)
        made = make_authority(
            authority.cert, authority.key, [authority.cert, middle, pki.root], [pki.root]
        )
        assert made.cert == authority.cert
        assert made.intermediates == (middle,)
        assert made.roots == (pki.root,)
        made.validate(now=NOW)

    def test_plugged_in_chain_of_cert_and_root(self, pki: Pki) -> None:
        made = make_authority(
            pki.intermediate, pki.intermediate_key, [pki.intermediate, pki.root], [pki.root]
        )
        assert made.intermediates == ()
        assert not made.is_self_signed_root
        leaf = make_leaf(pki)
        assert len(made.response_chain(leaf)) == 3

    def test_self_signed_layout(self, pki: Pki) -> None:
        made = make_authority(pki.root, pki.root_key, [pki.root], [pki.root])
        assert made.intermediates == ()
        assert made.is_self_signed_root
        made.validate(now=NOW)


class TestProperties:
    def test_chain_pem_is_cert_then_intermediates(self, pki: Pki) -> None:
        authority, middle = _two_level(pki)
        assert authority.chain_pem == certs_to_pem([authority.cert, middle])
        assert authority.root_bundle_pem == cert_to_pem(pki.root)

    def test_not_after_is_earliest_expiry_along_the_chain(self, pki: Pki) -> None:
        authority, middle = _two_level(pki)
        assert authority.cert.not_valid_after_utc < middle.not_valid_after_utc
        assert authority.not_after == authority.cert.not_valid_after_utc
        # A middle certificate that expires first bounds the leaves too.
        swapped = SigningAuthority(
            cert=middle, key=pki.intermediate_key, intermediates=(), roots=(pki.root,)
        )
        assert swapped.not_after == middle.not_valid_after_utc

    def test_not_after_is_bounded_by_the_root(self, pki: Pki) -> None:
        """A plugged-in intermediate that outlives its (re-issued, shorter) root must not let
        leaves outlive the root: they would stop verifying when the root expires."""
        short_root = build_root_certificate(
            pki.root_key, TRUST_DOMAIN, now=NOW - timedelta(days=1), lifetime=timedelta(days=30)
        )
        assert pki.intermediate.not_valid_after_utc > short_root.not_valid_after_utc
        authority = SigningAuthority(
            cert=pki.intermediate,
            key=pki.intermediate_key,
            intermediates=(),
            roots=(short_root,),
        )
        authority.validate(now=NOW)
        assert authority.not_after == short_root.not_valid_after_utc
