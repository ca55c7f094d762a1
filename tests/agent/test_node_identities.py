"""Node identity sources: the pod index, the pod watch against the fake API server with the real
`kubernetes` client (including a 410 re-list), the static list, and the node agent end to end:
an identity appears with its first pod on the node and disappears (SDS resource, files, rotation)
with its last one."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from agent.backoff import Backoff
from agent.config import AgentConfig, ConfigError
from agent.identity_source import IdentitySet, IdentitySource
from agent.identity_sources import SingleIdentitySource, identity_source_for
from agent.main import Agent
from agent.node_identities import (
    PodIdentitySource,
    StaticIdentitySource,
    identities_of,
    kube_api_client_factory,
)
from agent.rotation import SINGLE_IDENTITY_BACKOFF
from agent.token import FileTokenProvider
from certs import SpiffeId
from meshca.clock import SystemClock
from meshca.pods import pod_info
from tests.agent.test_node_agent import fetch_secrets
from tests.support.agent_wiring import scheduler_of, until
from tests.support.deploy_rbac import is_allowed
from tests.support.fake_ca import NODE_TOKEN, node_ca, start_fake_ca
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import NODE_AGENT_RBAC, describe, required_rules
from tests.support.pki import TestCa

NODE, OTHER = "node-1", "node-2"


def sid(namespace: str, account: str) -> SpiffeId:
    return SpiffeId("cluster.local", namespace, account)


def source_for(config: AgentConfig) -> IdentitySource:
    """The agent's one identity source for `config` (the pod agent's parts unused in node mode)."""
    tokens = FileTokenProvider(config.token_path, required=False)
    return identity_source_for(
        config, tokens, SystemClock(), SINGLE_IDENTITY_BACKOFF, on_failure=lambda _: None
    )


def pod(namespace: str, name: str, account: str, phase: str = "Running") -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(namespace=namespace, name=name),
        spec=client.V1PodSpec(containers=[], service_account_name=account, node_name=NODE),
        status=client.V1PodStatus(phase=phase),
    )


@pytest.fixture
def kube(starts_processes: None) -> Iterator[KubeApiServer]:
    server = KubeApiServer().start()
    for namespace in ("shop", "web"):
        server.create_namespace(namespace)
    try:
        yield server
        needed = required_rules(server.requests(), "istio-system")
        denied = {rule for rule in needed if not is_allowed(set(NODE_AGENT_RBAC), rule)}
        assert not denied, f"node agent calls its RBAC does not allow: {describe(denied)}"
    finally:
        server.stop()


def test_identities_come_from_live_pods_only() -> None:
    def of(*pods: client.V1Pod) -> IdentitySet:
        return identities_of([pod_info(p) for p in pods], "cluster.local")

    assert of(pod("shop", "cart-1", "cart"), pod("shop", "done", "job", "Succeeded")) == {
        sid("shop", "cart")
    }
    assert of(pod("shop", "cart-1", "cart"), pod("shop", "cart-2", "cart")) == {sid("shop", "cart")}
    assert of(pod("shop", "cart-2", "cart", "Failed"), pod("web", "front-1", "front")) == {
        sid("web", "front")
    }
    # Not yet running still counts: the pod needs its certificate before its containers start.
    assert of(pod("web", "front-1", "front", "Pending")) == {sid("web", "front")}


def test_stop_abandons_a_pod_list_in_flight(kube: KubeApiServer, tmp_path: Path) -> None:
    """A slow API server must not hold up stopping the node agent, and a list answered after
    the stop must not be reported."""

    async def main() -> None:
        config = AgentConfig(
            node_mode=True, node_name=NODE, kubeconfig=kube.write_kubeconfig(tmp_path / "kc")
        )
        kube.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
        kube.delay_lists(3.0)
        source = PodIdentitySource(NODE, "cluster.local", kube_api_client_factory(config))
        snapshots: list[IdentitySet] = []
        source.start(snapshots.append)
        await until(lambda: kube.count("list", "pods") >= 1)
        await asyncio.sleep(0.2)  # the list is being answered slowly
        loop = asyncio.get_running_loop()
        started = loop.time()
        await source.stop()
        assert loop.time() - started < 1.0, "stop waited for the slow list"
        await asyncio.sleep(3.5)  # the list has been answered by now
        assert snapshots == [] and source.lists == 0
        assert kube.count("watch", "pods") == 0

    asyncio.run(main())


def test_pod_source_sees_only_this_nodes_pods_and_relists_after_410(
    kube: KubeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.node_identities")

    async def main() -> None:
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        config = AgentConfig(node_mode=True, node_name=NODE, kubeconfig=kubeconfig)
        assert isinstance(source_for(config), PodIdentitySource)
        # Short watches without bookmarks: the resume version is the last event on this node,
        # so compaction after other nodes' changes makes the next resume a 410 Gone.
        source = PodIdentitySource(
            NODE,
            "cluster.local",
            kube_api_client_factory(config),
            watch_timeout_seconds=1,
            bookmarks=False,
        )
        kube.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
        kube.create_pod("shop", "elsewhere", service_account="pay", node_name=OTHER)
        snapshots: list[IdentitySet] = []
        source.start(snapshots.append)
        try:
            await until(lambda: len(snapshots) >= 1)
            assert snapshots[-1] == {sid("shop", "cart")}

            kube.create_pod("web", "front-1", service_account="front", node_name=NODE)
            kube.create_pod("web", "other-1", service_account="other", node_name=OTHER)
            await until(lambda: sid("web", "front") in snapshots[-1])
            assert snapshots[-1] == {sid("shop", "cart"), sid("web", "front")}

            kube.create_pod("web", "other-2", service_account="other", node_name=OTHER)
            kube.compact()  # the next resume, from front-1's resourceVersion, gets 410 Gone
            await until(lambda: source.lists >= 2, timeout=10)
            assert "410 Gone" in caplog.text
            kube.create_pod("shop", "cart-2", service_account="cart", node_name=NODE)
            kube.delete("pods", "cart-1", namespace="shop")
            await asyncio.sleep(0.2)
            assert snapshots[-1] == {sid("shop", "cart"), sid("web", "front")}
            kube.delete("pods", "cart-2", namespace="shop")
            await until(lambda: snapshots[-1] == {sid("web", "front")}, timeout=10)
        finally:
            await source.stop()
        assert all(sid("shop", "pay") not in s and sid("web", "other") not in s for s in snapshots)

    asyncio.run(main())


def test_static_source_and_choice_of_source(tmp_path: Path) -> None:
    config = AgentConfig(node_mode=True, identities=(("shop", "cart"), ("web", "front")))
    source = source_for(config)
    assert isinstance(source, StaticIdentitySource)
    assert source.identities() == {sid("shop", "cart"), sid("web", "front")}
    sidecar = AgentConfig(namespace="shop", service_account="cart")
    assert isinstance(source_for(sidecar), SingleIdentitySource)
    with pytest.raises(ConfigError, match="identity source"):
        AgentConfig(node_mode=True)
    with pytest.raises(ConfigError, match="NODE_NAME"):
        AgentConfig(node_mode=True, kubeconfig=tmp_path / "kubeconfig")
    bad = StaticIdentitySource("cluster.local", [], tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot be read"):
        bad.identities()


def test_node_agent_adds_and_drops_identities_as_pods_come_and_go(kube: KubeApiServer) -> None:
    async def main(tmp: Path) -> None:
        clock = SystemClock()
        ca = node_ca(TestCa(datetime.now(UTC)), clock, delay=0)
        server, addr = await start_fake_ca(ca, tmp, clock.now())
        (tmp / "token").write_text(NODE_TOKEN)
        kube.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
        kube.create_pod("shop", "cart-2", service_account="cart", node_name=NODE)
        kube.create_pod("web", "front-1", service_account="front", node_name=OTHER)
        config = AgentConfig(
            ca_addr=addr,
            ca_root_ca=tmp / "root-cert.pem",
            token_path=tmp / "token",
            sds_socket=tmp / "sds" / "socket",
            output_certs=tmp / "certs",
            status_port=0,
            secret_ttl=timedelta(seconds=2),  # renewals every ~1 s show that rotation stops
            node_mode=True,
            node_name=NODE,
            kubeconfig=kube.write_kubeconfig(tmp / "kubeconfig"),
        )
        agent = Agent(config, clock=SystemClock())
        await agent.start()
        manager = scheduler_of(agent)
        cart, front = sid("shop", "cart"), sid("web", "front")
        try:
            await until(lambda: agent.cache.get(cart.uri) is not None)
            assert manager.identities == {cart}  # front's only pod is on another node
            assert manager.has_valid_certificate()

            kube.create_pod("web", "front-2", service_account="front", node_name=NODE)
            await until(lambda: agent.cache.get(front.uri) is not None)
            assert set(await fetch_secrets(config.sds_socket, [front.uri, cart.uri])) == {
                front.uri,
                cart.uri,
            }
            assert (tmp / "certs" / "web" / "front" / "cert-chain.pem").exists()

            kube.delete("pods", "cart-1", namespace="shop")  # cart-2 still runs here
            await asyncio.sleep(0.3)
            assert cart in manager.identities
            kube.delete("pods", "cart-2", namespace="shop")  # the last one
            await until(lambda: agent.cache.get(cart.uri) is None)
            assert manager.identities == {front}
            assert not (tmp / "certs" / "shop").exists()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await fetch_secrets_briefly(config.sds_socket, cart.uri)
            assert info.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            issued_cart, issued_front = ca.issued[cart.uri], ca.issued[front.uri]
            await asyncio.sleep(2.5)  # more than two renewal periods
            assert ca.issued[cart.uri] == issued_cart  # rotation stopped
            assert ca.issued[front.uri] > issued_front  # the remaining identity still renews
        finally:
            await agent.stop()
            await server.stop(None)

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        asyncio.run(main(Path(tmp)))


async def fetch_secrets_briefly(socket: Path, name: str) -> None:
    from envoy.service.discovery.v3 import discovery_pb2
    from envoy.service.secret.v3 import sds_pb2_grpc

    from tests.agent.test_node_agent import NODE as PROXY

    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        await stub.FetchSecrets(
            discovery_pb2.DiscoveryRequest(node=PROXY, resource_names=[name]), timeout=0.5
        )


def test_kube_client_factory_reads_the_kubeconfig(kube: KubeApiServer, tmp_path: Path) -> None:
    config = AgentConfig(
        node_mode=True, node_name=NODE, kubeconfig=kube.write_kubeconfig(tmp_path / "kc")
    )
    api = client.CoreV1Api(kube_api_client_factory(config)())
    assert api.api_client.configuration.host == kube.url


def test_node_flags_and_environment() -> None:
    import argparse

    from agent.config import add_agent_arguments

    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    args = parser.parse_args(
        ["--node-mode", "--kubeconfig", "/kc", "--max-concurrent-fetches", "4"]
    )
    config = AgentConfig.from_args(args, {"NODE_NAME": "node-7"})
    assert config.node_mode and config.node_name == "node-7"
    assert config.kubeconfig == Path("/kc") and config.max_concurrent_fetches == 4
    static = parser.parse_args(["--node-mode", "--identities", "shop/cart, web/front,shop/cart"])
    assert AgentConfig.from_args(static, {}).identities == (("shop", "cart"), ("web", "front"))
    in_cluster = AgentConfig.from_args(
        parser.parse_args(["--node-mode"]),
        {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "NODE_NAME": "n"},
    )
    assert in_cluster.in_cluster and in_cluster.kubeconfig is None
    with pytest.raises(ConfigError, match="NAMESPACE/SERVICE_ACCOUNT"):
        AgentConfig.from_args(parser.parse_args(["--node-mode", "--identities", "cart"]), {})
    with pytest.raises(ConfigError, match="at least 1"):
        AgentConfig.from_args(parser.parse_args(["--max-concurrent-fetches", "0"]), {})


def test_pod_source_retries_building_its_api_client(kube: KubeApiServer, tmp_path: Path) -> None:
    """A kubeconfig (or in-cluster token) not there yet is retried, not the end of the watch."""

    async def main() -> None:
        kubeconfig = tmp_path / "kubeconfig"
        config = AgentConfig(node_mode=True, node_name=NODE, kubeconfig=kubeconfig)
        build = kube_api_client_factory(config)
        attempts: list[bool] = []

        def factory() -> Any:
            attempts.append(kubeconfig.exists())
            return build()

        source = PodIdentitySource(
            NODE, "cluster.local", factory, backoff=Backoff(initial=0.05, maximum=0.1)
        )
        kube.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
        snapshots: list[IdentitySet] = []
        source.start(snapshots.append)
        try:
            await until(lambda: len(attempts) >= 2 or not source.watching)
            assert attempts[0] is False and not snapshots
            kube.write_kubeconfig(kubeconfig)
            await until(lambda: len(snapshots) >= 1, timeout=20)
            assert snapshots[-1] == {sid("shop", "cart")}
        finally:
            await source.stop()

    asyncio.run(main())
