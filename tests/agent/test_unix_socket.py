"""The agent's three Unix-socket servers (SDS, the pod Workload API, the node relay) under
`agent.unix_socket`'s one rule, in-process on real sockets: a socket another process serves on
is refused and left serving, a dead one is taken over, a stop removes only the socket the
server bound, and a gRPC socket closes connections past its cap while a client it already
serves keeps being served. The same with real agent processes: tests/agent/test_agent_sockets.py.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.errors import SocketPathRefused
from agent.metrics import AgentMetrics
from agent.sds import SECRET_TYPE_URL, SdsServer
from agent.secrets import SecretCache
from agent.unix_socket import UnixSocketPath, grpc_connection_cap
from agent.workload.api import WorkloadApiServer
from agent.workload.relay import PeerRelay
from meshca.clock import SystemClock
from tests.support.connection_flood import flood
from tests.support.loop import LoopThread
from tests.support.pki import TestCa
from tests.support.sds_client import leaf_serial, unpack
from tests.support.workload_api import SvidWatch
from tests.support.workload_api_server import pod_server

CAP = 4


class SocketServer(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class _Stoppable:
    """A server whose `stop` takes a grace period, seen with the relay's signature."""

    server: SdsServer | WorkloadApiServer

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)


def _sds(path: Path) -> SocketServer:
    return _Stoppable(SdsServer(SecretCache(), path))


def _workload_api(path: Path) -> SocketServer:
    metrics = AgentMetrics(SystemClock())
    return _Stoppable(WorkloadApiServer(SecretCache(), path, trust_domain="td", metrics=metrics))


def _relay(path: Path) -> SocketServer:
    return PeerRelay(path, lambda peer: "pod")


SERVERS: dict[str, Callable[[Path], SocketServer]] = {
    "sds": _sds,
    "workload-api": _workload_api,
    "node-relay": _relay,
}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="usock", dir="/tmp") as directory:
        yield Path(directory)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    with LoopThread() as running:
        yield running


@contextmanager
def listening(path: Path) -> Iterator[socket.socket]:
    """Another process's live socket at `path` (a SPIRE agent, another meshca agent)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(path))
        other.listen(8)
        yield other


def inode(path: Path) -> tuple[int, int]:
    status = os.lstat(path)
    return status.st_dev, status.st_ino


def answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


@pytest.mark.parametrize("kind", SERVERS)
def test_a_socket_another_process_serves_on_is_refused_and_left_serving(
    kind: str, sock_dir: Path, loop: LoopThread
) -> None:
    """The SDS server used to log "removing stale SDS socket" and take a live socket over."""
    path = sock_dir / "taken.sock"
    with listening(path):
        before = inode(path)
        server = SERVERS[kind](path)
        with pytest.raises(SocketPathRefused, match="another process is serving on") as refused:
            loop.run(server.start())
        assert str(path) in str(refused.value)
        loop.run(server.stop())  # what the agent does after a refused start
        assert inode(path) == before, "the live socket was replaced"
        assert answers(path), "the live socket no longer answers"


@pytest.mark.parametrize("kind", SERVERS)
def test_a_dead_socket_is_taken_over(
    kind: str, sock_dir: Path, loop: LoopThread, caplog: pytest.LogCaptureFixture
) -> None:
    path = sock_dir / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as crashed:
        crashed.bind(str(path))  # bound, then closed without unlink: its server died
    server = SERVERS[kind](path)
    with caplog.at_level(logging.INFO):
        loop.run(server.start())
    try:
        assert answers(path)
        assert any(
            "stale" in record.getMessage() and str(path) in record.getMessage()
            for record in caplog.records
        ), "the takeover of a dead socket is not logged"
    finally:
        loop.run(server.stop())
    assert not path.exists()


@pytest.mark.parametrize("kind", SERVERS)
def test_stop_removes_only_the_socket_this_server_bound(
    kind: str, sock_dir: Path, loop: LoopThread
) -> None:
    """A successor took the path over (this server was stopped uncleanly, or thought dead):
    this server's stop must leave the successor's socket where its clients look for it."""
    path = sock_dir / "shared.sock"
    server = SERVERS[kind](path)
    loop.run(server.start())
    os.unlink(path)
    with listening(path):
        successor = inode(path)
        loop.run(server.stop())
        assert path.exists(), "the successor's socket was removed"
        assert inode(path) == successor and answers(path)


@pytest.mark.parametrize("kind", SERVERS)
def test_a_path_that_is_not_a_socket_is_refused_and_kept(
    kind: str, sock_dir: Path, loop: LoopThread
) -> None:
    path = sock_dir / "a-file"
    path.write_text("not a socket")
    server = SERVERS[kind](path)
    with pytest.raises(SocketPathRefused, match="exists and is not a socket"):
        loop.run(server.start())
    loop.run(server.stop())
    assert path.read_text() == "not a socket"


def test_the_parent_is_made_0700_and_a_long_path_refused(sock_dir: Path) -> None:
    path = sock_dir / "made" / "here.sock"
    UnixSocketPath(path, "SDS socket").prepare()
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        UnixSocketPath(Path("/tmp/" + "x" * 120), "SDS socket")
    with pytest.raises(ValueError, match="at least 1"):
        grpc_connection_cap(0)


def test_a_socket_bound_at_the_path_during_start_is_not_replaced(sock_dir: Path) -> None:
    """Two agents starting at once on one path both find it free: the second to put its
    socket there is refused, instead of replacing the first's and leaving it unreachable."""
    path = sock_dir / "raced.sock"
    claim = UnixSocketPath(path, "SDS socket")
    bind_path = claim.prepare()
    with listening(path), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as ours:
        first = inode(path)
        ours.bind(str(bind_path))
        ours.listen(1)
        with pytest.raises(SocketPathRefused, match="while this agent was starting"):
            claim.claim(0o600)
        claim.release()
        assert inode(path) == first and answers(path)
        assert not bind_path.exists()


# --- connection caps -------------------------------------------------------------------------


def _fetch(channel: grpc.Channel, name: str) -> int:
    stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
    response = stub.FetchSecrets(
        discovery_pb2.DiscoveryRequest(
            node=base_pb2.Node(id="envoy"), resource_names=[name], type_url=SECRET_TYPE_URL
        ),
        timeout=10,
    )
    return leaf_serial(unpack(response.resources[0]))


def test_the_sds_socket_closes_connections_past_its_cap(sock_dir: Path, loop: LoopThread) -> None:
    """An Envoy connected first is still served while more connections than the cap are held;
    each one past the cap is closed at accept; when the flood ends, new clients get in."""
    ca = TestCa()
    cache = SecretCache()
    loop.run(cache.publish(ca.issue("app").tls_secret()))
    path = sock_dir / "sds.sock"
    server = SdsServer(cache, path, max_connections=CAP)
    loop.run(server.start())
    try:
        with grpc.insecure_channel(f"unix:{path}") as envoy:
            _fetch(envoy, "default")
            with flood(path, CAP + 6) as held:
                held.classify()
                assert len(held.kept) == CAP - 1, "the cap counts the Envoy's connection too"
                assert len(held.closed) == 7
                rotated = ca.issue("app")
                loop.run(cache.publish(rotated.tls_secret()))
                assert _fetch(envoy, "default") == int(rotated.cert.serial_number)
        with grpc.insecure_channel(f"unix:{path}") as newcomer:
            assert _fetch(newcomer, "default") == int(rotated.cert.serial_number)
    finally:
        loop.run(server.stop(0))


def test_the_pod_workload_api_socket_closes_connections_past_its_cap(sock_dir: Path) -> None:
    """The pod agent's Workload API held every connection (3,000 idle ones, bounded only by
    the descriptor limit): now one past the cap is closed, and the application that was
    already watching its SVID still gets the rotated one."""
    ca = TestCa()
    path = sock_dir / "api.sock"
    with pod_server(path, ca, ca.issue("app"), max_connections=CAP) as hosted:
        watch = SvidWatch(path)
        try:
            watch.next(10)
            with flood(path, CAP + 6) as held:
                held.classify()
                assert len(held.kept) == CAP - 1
                assert len(held.closed) == 7
                rotated = ca.issue("app")
                hosted.publish(rotated.tls_secret())
                assert watch.next(10).serial == int(rotated.cert.serial_number)
        finally:
            watch.close()


def test_the_node_relay_closes_connections_past_its_cap(sock_dir: Path, loop: LoopThread) -> None:
    """The node agent's public socket is the relay's, which counts its own connections: a
    client relayed first is still answered while the flood past the cap is closed."""
    relay = PeerRelay(sock_dir / "node.sock", lambda peer: "pod", max_connections=CAP)

    async def start() -> grpc.aio.Server:
        upstream = grpc.aio.server()  # no services: every call answers UNIMPLEMENTED
        upstream.add_insecure_port(relay.grpc_address)
        await upstream.start()
        await relay.start()
        return upstream

    async def stop(upstream: grpc.aio.Server) -> None:
        await relay.stop()
        await upstream.stop(0)

    def answered(channel: grpc.Channel) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as call:
            channel.unary_unary("/SpiffeWorkloadAPI/FetchJWTSVID")(b"", timeout=10)
        return call.value.code()

    upstream = loop.run(start())
    try:
        with grpc.insecure_channel(f"unix:{relay.public_path}") as client:
            assert answered(client) == grpc.StatusCode.UNIMPLEMENTED
            with flood(relay.public_path, CAP + 6) as held:
                held.classify()
                assert len(held.kept) == CAP - 1
                assert len(held.closed) == 7
                assert answered(client) == grpc.StatusCode.UNIMPLEMENTED
    finally:
        loop.run(stop(upstream))
