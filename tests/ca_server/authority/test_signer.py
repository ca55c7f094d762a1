"""The signer hands back what the request path reads of a leaf (serial, notAfter, authority key
id, the PEM chain) without parsing the leaf: each must be exactly what the leaf holds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from ca_server.authority.signer import LocalSigner
from ca_server.ttl import Validity
from certs import (
    KeySpec,
    SpiffeId,
    cert_to_pem,
    generate_private_key,
    issuer_key_id,
    make_authority,
    new_self_signed_authority,
)
from tests.support.pki_views import Pki, make_pki

SLEEP = SpiffeId("cluster.local", "default", "sleep")
NOW = datetime(2026, 12, 5, 7, 30, 15, 654321, tzinfo=UTC)


@pytest.mark.parametrize(
    "not_after",
    [
        NOW + timedelta(hours=1),  # microseconds: the leaf holds whole seconds
        (NOW + timedelta(hours=2)).astimezone(timezone(timedelta(hours=-5))),  # not in UTC
        (NOW + timedelta(hours=3)).replace(tzinfo=None),  # naive: taken as UTC
        datetime(2051, 1, 1, 0, 0, 0, 999999, tzinfo=UTC),  # GeneralizedTime
    ],
)
def test_what_the_signer_says_is_what_the_leaf_holds(not_after: datetime) -> None:
    pki: Pki = make_pki()
    authorities = [
        new_self_signed_authority(
            KeySpec(), "cluster.local", now=NOW, lifetime=timedelta(days=9000)
        ),
        make_authority(pki.intermediate, pki.intermediate_key, [pki.intermediate], [pki.root]),
    ]
    for authority in authorities:
        signer = LocalSigner(authority)
        validity = Validity(NOW - timedelta(minutes=1), not_after, None, None)
        issued = signer.sign(generate_private_key(KeySpec()).public_key(), SLEEP, validity)
        leaf = issued.leaf
        assert issued.serial == leaf.serial_number
        assert issued.not_after == leaf.not_valid_after_utc
        assert issued.issuer_key_id == issuer_key_id(leaf) is not None
        assert issued.cert_chain == authority.response_chain(leaf)
        assert issued.cert_chain[0] == cert_to_pem(leaf)


def test_a_leaf_never_outlives_the_authority_that_signs_it() -> None:
    """The TTL is clamped against the authority the request path saw; when a reload swaps in a
    shorter-lived one before the signature (handlers run off the event loop), the signer clamps
    again rather than sign a leaf its chain does not cover."""
    long_lived = new_self_signed_authority(
        KeySpec(), "cluster.local", now=NOW, lifetime=timedelta(days=365)
    )
    short_lived = new_self_signed_authority(
        KeySpec(), "cluster.local", now=NOW, lifetime=timedelta(hours=2)
    )
    signer = LocalSigner(long_lived)
    validity = Validity(NOW - timedelta(minutes=1), NOW + timedelta(days=1), None, None)
    signer.replace(short_lived)  # after the TTL was granted against `long_lived`
    issued = signer.sign(generate_private_key(KeySpec()).public_key(), SLEEP, validity)
    assert issued.not_after == issued.leaf.not_valid_after_utc <= short_lived.not_after
    assert issued.leaf.not_valid_after_utc > NOW + timedelta(hours=1)
