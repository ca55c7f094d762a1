"""The wired-up Agent in node mode against an in-process TLS gRPC CA that signs impersonated
identities: 100 identities, never more than 8 CSRs in flight (measured by the server), each
certificate served over SDS under its SPIFFE ID, per-identity files, metrics and readiness.
Identities come from the static list, so no API server is involved."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import tempfile
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.config import AgentConfig
from agent.main import Agent
from certs import (
    SpiffeId,
    describe_certificate,
    key_matches_certificate,
    load_cert,
    load_private_key,
)
from meshca.clock import SystemClock
from meshca.commands.status import add_arguments, run
from tests.agent.test_agent_inprocess import status
from tests.support.agent_wiring import node_agent_config, scheduler_of, until
from tests.support.fake_ca import NODE_TOKEN, FakeCaServicer, node_ca, start_fake_ca
from tests.support.pki import TestCa
from tests.support.processes import http_text

NODE = base_pb2.Node(id="ztunnel~10.0.0.1~node-1~meshca-system.svc.cluster.local")


async def fetch_secrets(socket: Path, names: Sequence[str]) -> dict[str, secret_pb2.Secret]:
    """FetchSecrets over the SDS Unix socket, as a proxy would."""
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        response = await stub.FetchSecrets(
            discovery_pb2.DiscoveryRequest(node=NODE, resource_names=list(names)), timeout=5
        )
    secrets = {}
    for resource in response.resources:
        secret = secret_pb2.Secret()
        resource.Unpack(secret)
        secrets[secret.name] = secret
    return secrets


def test_node_agent_serves_100_identities_with_at_most_8_csrs_in_flight() -> None:
    async def main(tmp: Path) -> None:
        clock = SystemClock()
        ca = node_ca(TestCa(datetime.now(UTC)), clock, delay=0.03)
        server, addr = await start_fake_ca(ca, tmp, clock.now())
        (tmp / "token").write_text(NODE_TOKEN)
        pairs = tuple((f"ns{i % 10}", f"sa{i}") for i in range(100))
        config = node_agent_config(tmp, addr, pairs)
        assert config.max_concurrent_fetches == 8
        agent = Agent(config, clock=SystemClock())
        await agent.start()
        try:
            manager = scheduler_of(agent)
            await until(lambda: manager.has_valid_certificate(), timeout=30)
            assert await status(f"{agent.status.url}/healthz/ready") == 200
            assert len(ca.issued) == 100 and set(ca.issued.values()) == {1}
            assert ca.max_in_flight == 8  # saturated, never exceeded (counted by the server)
            assert manager.max_in_flight == 8

            ids = [SpiffeId("cluster.local", ns, sa) for ns, sa in pairs]
            picked = [ids[0], ids[37], ids[99]]
            secrets = await fetch_secrets(config.sds_socket, [i.uri for i in picked] + ["ROOTCA"])
            assert set(secrets) == {i.uri for i in picked} | {"ROOTCA"}
            for identity in picked:
                tls = secrets[identity.uri].tls_certificate
                leaf = load_cert(tls.certificate_chain.inline_bytes)
                assert describe_certificate(leaf).uri_sans == (identity.uri,)
                assert key_matches_certificate(load_private_key(tls.private_key.inline_bytes), leaf)
            assert secrets["ROOTCA"].validation_context.trusted_ca.inline_bytes.decode() == (
                ca.pki.root_pem
            )

            files = tmp / "certs" / "ns7" / "sa37"
            leaf = load_cert((files / "cert-chain.pem").read_bytes())
            assert describe_certificate(leaf).uri_sans == (ids[37].uri,)
            assert (files / "root-cert.pem").read_text() == ca.pki.root_pem
            assert (files / "key.pem").stat().st_mode & 0o777 == 0o600

            metrics = await asyncio.to_thread(http_text, f"{agent.status.url}/metrics")
            assert f'cert_expiry_seconds{{resource_name="{ids[37].uri}"}}' in metrics
            assert "meshca_agent_node_identities 100.0" in metrics
            assert "meshca_agent_fetches_in_flight 0.0" in metrics
            assert "meshca_agent_rotations_total 100.0" in metrics
        finally:
            await agent.stop()
            await server.stop(None)

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        asyncio.run(main(Path(tmp)))


@contextlib.asynccontextmanager
async def static_node_agent(
    tmp: Path, identities: str
) -> AsyncIterator[tuple[Agent, FakeCaServicer]]:
    """A started node-mode Agent whose identities come from a static file (`identities`), with
    an in-process CA that signs impersonated identities; both stopped on exit."""
    clock = SystemClock()
    ca = node_ca(TestCa(datetime.now(UTC)), clock, delay=0)
    server, addr = await start_fake_ca(ca, tmp, clock.now())
    (tmp / "token").write_text(NODE_TOKEN)
    (tmp / "identities").write_text(identities)
    config = AgentConfig(
        ca_addr=addr,
        ca_root_ca=tmp / "root-cert.pem",
        token_path=tmp / "token",
        sds_socket=tmp / "sds" / "socket",
        status_port=0,
        node_mode=True,
        identities_file=tmp / "identities",
    )
    agent = Agent(config, clock=clock)
    await agent.start()
    try:
        yield agent, ca
    finally:
        await agent.stop()
        await server.stop(None)


def test_static_identities_file_without_an_api_server() -> None:
    async def main(tmp: Path) -> None:
        identities = "# this node's workloads\nshop/cart\nshop/pay, web/front\n"
        async with static_node_agent(tmp, identities) as (agent, ca):
            await until(lambda: scheduler_of(agent).has_valid_certificate())
            assert sorted(ca.issued) == [
                "spiffe://cluster.local/ns/shop/sa/cart",
                "spiffe://cluster.local/ns/shop/sa/pay",
                "spiffe://cluster.local/ns/web/sa/front",
            ]
            secrets = await fetch_secrets(
                agent.config.sds_socket, ["spiffe://cluster.local/ns/web/sa/front"]
            )
            assert secrets

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        asyncio.run(main(Path(tmp)))


def test_status_in_node_mode_and_an_identity_that_leaves_has_no_series() -> None:
    """`meshca status` lists one row per identity on the node (plus ROOTCA); when an identity
    leaves the node, its row and every series labelled with it are gone at the next read."""

    async def status_command(*args: str) -> str:
        out = io.StringIO()
        parsed = argparse.ArgumentParser()
        add_arguments(parsed)
        code = await asyncio.to_thread(run, parsed.parse_args([*args]), out)
        assert code == 0
        return out.getvalue()

    async def main(tmp: Path) -> None:
        async with static_node_agent(tmp, "shop/cart\nshop/pay\n") as (agent, _):
            await check(agent)

    async def check(agent: Agent) -> None:
        cart, pay = (SpiffeId("cluster.local", "shop", sa) for sa in ("cart", "pay"))
        address = f"{agent.status.host}:{agent.status.port}"
        manager = scheduler_of(agent)
        await until(lambda: manager.has_valid_certificate())
        table = await status_command(address)
        rows = {line.split()[0]: line for line in table.splitlines()[1:]}
        assert set(rows) == {"ROOTCA", cart.uri, pay.uri}
        assert "Cert Chain  ACTIVE  true" in rows[cart.uri]
        document = json.loads(await status_command("-o", "json", address))
        entries = {entry["resource_name"]: entry for entry in document["secrets"]}
        served = await fetch_secrets(agent.config.sds_socket, [cart.uri, pay.uri])
        for identity in (cart, pay):
            chain = served[identity.uri].tls_certificate.certificate_chain.inline_bytes
            leaf = load_cert(chain)
            entry = entries[identity.uri]
            assert entry["serial"] == f"{leaf.serial_number:x}"
            assert entry["not_after"] == leaf.not_valid_after_utc.isoformat()
            assert entry["type"] == "cert_chain" and entry["status"] == "ACTIVE"
            assert entry["consecutive_failures"] == 0 and entry["next_rotation"]
        metrics = await asyncio.to_thread(http_text, f"{agent.status.url}/metrics")
        assert metrics.count(f'resource_name="{pay.uri}"') >= 6  # every per-cert series

        manager.set_identities(frozenset({cart}))  # the last pod of shop/pay left
        await until(lambda: agent.cache.get(pay.uri) is None)
        metrics = await asyncio.to_thread(http_text, f"{agent.status.url}/metrics")
        assert pay.uri not in metrics and cart.uri in metrics
        table = await status_command(address)
        assert pay.uri not in table and cart.uri in table

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        asyncio.run(main(Path(tmp)))
