"""`accept_certificate`: the one rule for the CA's answer, restored files and mounted files —
each check refuses on its own, in the documented order, and the optional checks are skipped
only when asked."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509

from agent.acceptance import accept_certificate
from agent.errors import CertificateRefused
from certs import PrivateKey, SpiffeId, build_csr, generate_private_key, load_cert, load_certs
from tests.support.fake_ca import IDENTITY
from tests.support.pki import TestCa

ISSUED = datetime(2030, 1, 1, tzinfo=UTC)
TTL = timedelta(hours=1)


def issued(pki: TestCa, identity: SpiffeId = IDENTITY) -> tuple[list[x509.Certificate], PrivateKey]:
    key = generate_private_key()
    leaf_pem = pki.sign_csr(build_csr(key, identity), TTL, ISSUED)[0]
    return [load_cert(leaf_pem)], key


def refusal(chain: list[x509.Certificate], key: PrivateKey, **kwargs: Any) -> str:
    with pytest.raises(CertificateRefused) as info:
        accept_certificate(chain, key, **kwargs)
    return str(info.value)


def test_a_chain_for_the_identity_and_key_that_verifies_is_accepted() -> None:
    pki = TestCa(ISSUED - timedelta(days=1))
    chain, key = issued(pki)
    roots = load_certs(pki.root_pem)
    accept_certificate(chain, key, now=ISSUED, identity=IDENTITY, roots=roots)


def test_each_check_refuses_on_its_own() -> None:
    pki = TestCa(ISSUED - timedelta(days=1))
    chain, key = issued(pki)
    roots = load_certs(pki.root_pem)
    other = SpiffeId("cluster.local", "default", "other")
    not_after = chain[0].not_valid_after_utc
    assert "expired at" in refusal(chain, key, now=not_after, identity=IDENTITY, roots=roots)
    early = ISSUED - timedelta(minutes=3)  # before the two-minute backdate
    assert "not valid until" in refusal(chain, key, now=early, identity=IDENTITY, roots=roots)
    reason = refusal(chain, key, now=ISSUED, identity=other, roots=roots)
    assert IDENTITY.uri in reason and other.uri in reason
    wrong_key = generate_private_key()
    assert "different private key" in refusal(chain, wrong_key, now=ISSUED, identity=IDENTITY)
    foreign = load_certs(TestCa(ISSUED - timedelta(days=1)).root_pem)
    assert "does not verify" in refusal(chain, key, now=ISSUED, roots=foreign)
    assert "empty" in refusal([], key, now=ISSUED)


def test_the_window_is_checked_before_the_identity() -> None:
    pki = TestCa(ISSUED - timedelta(days=1))
    chain, key = issued(pki)
    late = chain[0].not_valid_after_utc + timedelta(seconds=1)
    other = SpiffeId("cluster.local", "default", "other")
    assert "expired at" in refusal(chain, key, now=late, identity=other)


def test_identity_and_roots_are_optional_for_mounted_files() -> None:
    pki = TestCa(ISSUED - timedelta(days=1))
    chain, key = issued(pki, SpiffeId("cluster.local", "shop", "anything"))
    accept_certificate(chain, key, now=ISSUED)  # any identity, no bundle alongside
    with pytest.raises(CertificateRefused, match="different private key"):
        accept_certificate(chain, generate_private_key(), now=ISSUED)
