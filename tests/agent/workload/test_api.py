"""The Workload API server's own parts, in-process: the pairing of leaf and bundle updates,
the per-version encoding memo, and a first answer that waits for the first certificate."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path

from agent.metrics import AgentMetrics
from agent.secrets import DEFAULT_RESOURCE, ROOT_RESOURCE, SecretCache
from agent.workload.api import WorkloadApiServer, _Encodings, latest_pairs
from certs import load_der_certs
from meshca.clock import SystemClock
from tests.support.loop import LoopThread
from tests.support.pki import TestCa
from tests.support.workload_api import client_for


def test_pairs_wait_for_both_then_follow_either() -> None:
    ca = TestCa()

    async def main() -> None:
        cache = SecretCache()
        pairs = latest_pairs(cache.updates(DEFAULT_RESOURCE), cache.updates(ROOT_RESOURCE))
        first_leaf = ca.issue("app").tls_secret()
        await cache.publish(first_leaf)
        nothing_yet = asyncio.ensure_future(anext(pairs))
        await asyncio.sleep(0.05)
        assert not nothing_yet.done(), "a leaf without a bundle is not an answer"
        await cache.publish(ca.root_secret())
        leaf, bundle = await asyncio.wait_for(nothing_yet, 2)
        assert (leaf.version, bundle.version) == (first_leaf.version, ca.root_secret().version)
        other_root = TestCa().root_secret()
        await cache.publish(other_root)
        leaf, bundle = await asyncio.wait_for(anext(pairs), 2)
        assert leaf.version == first_leaf.version and bundle.version == other_root.version
        second_leaf = ca.issue("app").tls_secret()
        await cache.publish(second_leaf)
        leaf, bundle = await asyncio.wait_for(anext(pairs), 2)
        assert leaf.version == second_leaf.version and bundle.version == other_root.version
        await pairs.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())


def test_each_version_is_encoded_once_and_a_rotated_key_is_dropped() -> None:
    ca = TestCa()
    encodings = _Encodings()
    first = ca.issue("app")
    svid = encodings.svid(first.tls_secret())
    assert encodings.svid(first.tls_secret()) is svid  # shared by every stream
    assert [c.serial_number for c in load_der_certs(svid.chain_der)] == [first.serial]
    assert svid.spiffe_id == "spiffe://cluster.local/ns/default/sa/app"
    assert svid.key_der.hex()[:32] not in repr(svid) and "key" not in repr(svid)  # no key in logs
    second = ca.issue("app")
    renewed = encodings.svid(second.tls_secret())
    assert renewed.key_der != svid.key_der
    assert len(encodings._memo) == 1, "the rotated-out key is no longer held"
    small = _Encodings(limit=2)
    for name in ("a", "b", "c"):
        small.svid(ca.issue("app").tls_secret(name))
    assert list(small._memo) == ["b", "c"]


def test_the_first_answer_waits_for_the_first_certificate() -> None:
    """A client that connects before the agent holds a certificate is answered the moment
    the certificate is published, on the same call."""
    ca = TestCa()
    issued = ca.issue("app")
    cache = SecretCache()
    with tempfile.TemporaryDirectory(prefix="wapiu", dir="/tmp") as directory, LoopThread() as loop:
        server = WorkloadApiServer(
            cache,
            Path(directory) / "s",
            trust_domain="cluster.local",
            metrics=AgentMetrics(SystemClock()),
        )
        loop.run(server.start())
        try:
            got: list[int] = []
            with client_for(server.socket_path) as client:
                caller = threading.Thread(
                    target=lambda: got.append(int(client.fetch_x509_svid().leaf.serial_number))
                )
                caller.start()
                caller.join(0.5)
                assert caller.is_alive() and not got, "answered before there was anything"
                loop.run(cache.publish(ca.root_secret()))
                loop.run(cache.publish(issued.tls_secret()))
                caller.join(10)
            assert got == [issued.serial]
        finally:
            loop.run(server.stop(0.5))
