"""The trust bundle rule (`agent.trust_bundle`) and the CSR report fields (`agent.propagation`),
on a real `SecretCache` with the test PKI: parsing and refusals, the canonical digest, which
change wins, and the roots kept for a served leaf."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from prometheus_client import generate_latest

from agent.errors import TrustBundleRefused
from agent.metrics import AgentMetrics
from agent.propagation import (
    AGENT_ID_HEADER,
    LEAF_AUTHORITY_HEADER,
    TRUST_BUNDLE_HEADER,
    PropagationReport,
    leaf_authority,
    new_agent_id,
)
from agent.secrets import ROOT_RESOURCE, RootSecret, SecretCache
from agent.trust_bundle import (
    SOURCE_CA_RESPONSE,
    SOURCE_RESTORED,
    SOURCE_ROOT_FILE,
    TrustBundle,
    TrustBundleKeeper,
    bundle_digest,
)
from certs import certs_to_pem, load_certs
from meshca.clock import SystemClock
from tests.support.metrics import sample_value
from tests.support.pki import TestCa

NOW = datetime.now(UTC)


def served_roots(cache: SecretCache) -> list[x509.Certificate]:
    secret = cache.get(ROOT_RESOURCE)
    assert isinstance(secret, RootSecret)
    return load_certs(secret.trusted_ca_pem)


def test_parse_refuses_what_cannot_be_a_trust_bundle() -> None:
    ca = TestCa(NOW)
    leaf = ca.issue("app", now=NOW)
    with pytest.raises(TrustBundleRefused, match="not a PEM certificate bundle"):
        TrustBundle.parse("hello", what="root file", now=NOW)
    with pytest.raises(TrustBundleRefused, match="no CA certificate"):
        TrustBundle.parse(leaf.cert_pem, what="root file", now=NOW)
    expired = TestCa(NOW - timedelta(days=3), lifetime=timedelta(days=1))
    with pytest.raises(TrustBundleRefused, match="has expired"):
        TrustBundle.parse(expired.root_pem, what="root file", now=NOW)
    # A leaf beside a root is dropped, the root kept; duplicates collapse.
    bundle = TrustBundle.parse(ca.root_pem + leaf.cert_pem + ca.root_pem, what="x", now=NOW)
    assert bundle.roots == (ca.root,)


def test_digest_is_canonical_sorted_der_digests() -> None:
    a, b = TestCa(NOW).root, TestCa(NOW).root
    assert bundle_digest([a, b]) == bundle_digest([b, a, a])
    assert bundle_digest([a]) != bundle_digest([a, b])
    one = TrustBundle.parse(certs_to_pem([a, b]), what="x", now=NOW)
    other = TrustBundle.parse(certs_to_pem([b, a]), what="x", now=NOW)
    assert one.digest == other.digest and len(one.digest) == 64


def test_each_source_change_is_served_once_and_a_refusal_keeps_the_bundle() -> None:
    async def main() -> None:
        clock = SystemClock()
        cache, metrics = SecretCache(), AgentMetrics(clock)
        keeper = TrustBundleKeeper(cache, clock, metrics)
        trusted: list[bytes] = []
        keeper.add_trust_listener(trusted.append)
        old, new = TestCa(NOW), TestCa(NOW)

        assert await keeper.learn(old.root_pem, SOURCE_ROOT_FILE)
        assert await keeper.learn(old.root_pem, SOURCE_CA_RESPONSE) is False  # same roots
        assert served_roots(cache) == [old.root]
        both = old.root_pem + new.root_pem
        assert await keeper.learn(both, SOURCE_ROOT_FILE)
        assert served_roots(cache) == [old.root, new.root]
        assert trusted[-1] == both.encode()
        # The CA answers with the same roots as before: no change from it, the file stays.
        assert await keeper.learn(old.root_pem, SOURCE_CA_RESPONSE) is False
        assert served_roots(cache) == [old.root, new.root]

        assert await keeper.learn("not a certificate", SOURCE_ROOT_FILE) is False
        assert served_roots(cache) == [old.root, new.root]
        exposition = generate_latest(metrics.registry).decode()
        refused = "meshca_agent_trust_bundle_refused_total"
        updates = "meshca_agent_trust_bundle_updates_total"
        assert sample_value(exposition, refused, {"source": SOURCE_ROOT_FILE}) == 1
        assert sample_value(exposition, updates, {"source": SOURCE_ROOT_FILE}) == 2
        assert sample_value(exposition, "meshca_agent_trust_bundle_roots") == 2
        digest = keeper.digest
        assert digest is not None
        assert sample_value(exposition, "meshca_agent_trust_bundle_info", {"digest": digest[:16]})
        assert exposition.count("meshca_agent_trust_bundle_info{") == 1  # one series at a time

    asyncio.run(main())


def test_a_restored_bundle_never_overrides_a_live_source() -> None:
    async def main() -> None:
        clock = SystemClock()
        current, stale = TestCa(NOW), TestCa(NOW)
        cache = SecretCache()
        keeper = TrustBundleKeeper(cache, clock, AgentMetrics(clock))
        await keeper.learn(current.root_pem, SOURCE_ROOT_FILE)
        assert await keeper.learn(stale.root_pem, SOURCE_RESTORED) is False
        assert served_roots(cache) == [current.root]
        alone = SecretCache()  # no root file (or an unreadable one): the restored bundle serves
        alone_keeper = TrustBundleKeeper(alone, clock, AgentMetrics(clock))
        assert await alone_keeper.learn(stale.root_pem, SOURCE_RESTORED)
        assert served_roots(alone) == [stale.root]

    asyncio.run(main())


def test_a_root_anchoring_a_served_leaf_is_kept_until_the_leaf_is_replaced() -> None:
    async def main() -> None:
        clock = SystemClock()
        cache = SecretCache()
        keeper = TrustBundleKeeper(cache, clock, AgentMetrics(clock))
        old, new = TestCa(NOW), TestCa(NOW)
        await keeper.learn(old.root_pem, SOURCE_CA_RESPONSE, replacing="default")
        await cache.publish(old.issue("app", now=NOW).tls_secret())

        # The file now names only the new root: the old one stays while our leaf needs it.
        assert await keeper.learn(new.root_pem, SOURCE_ROOT_FILE)
        assert served_roots(cache) == [new.root, old.root]
        assert keeper.retained == (old.root,)

        # The renewal comes from the new authority: the old root goes with the old leaf.
        assert await keeper.learn(new.root_pem, SOURCE_CA_RESPONSE, replacing="default")
        assert served_roots(cache) == [new.root]
        await cache.publish(new.issue("app", now=NOW).tls_secret())
        assert await keeper.recheck() is False  # the new leaf verifies: nothing to keep
        assert keeper.retained == ()

    asyncio.run(main())


def test_propagation_headers() -> None:
    ca = TestCa(NOW)
    inter = ca.child_ca()
    leaf = inter.issue("app", now=NOW).cert
    ski = inter.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert leaf_authority(leaf) == ski.digest.hex()

    agent_id = new_agent_id("pod-1", random.Random(7))
    assert agent_id.startswith("pod-1-") and len(agent_id) == len("pod-1-") + 8
    assert new_agent_id("pod-1") != new_agent_id("pod-1")

    digests: list[str | None] = [None]
    report = PropagationReport(agent_id, lambda: digests[0])
    assert report.headers(None) == ((AGENT_ID_HEADER, agent_id),)
    digests[0] = "ab" * 32
    assert dict(report.headers("cd")) == {
        AGENT_ID_HEADER: agent_id,
        TRUST_BUNDLE_HEADER: "ab" * 32,
        LEAF_AUTHORITY_HEADER: "cd",
    }
