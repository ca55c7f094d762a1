"""The agent's three Unix-socket servers (SDS, the pod Workload API, the node relay) under
`agent.unix_socket`'s one rule, in-process on real sockets: a socket another process serves on
is refused and left serving, a dead one is taken over, and a stop removes only the socket the
server bound. The same with real agent processes: tests/agent/test_agent_sockets.py.
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

import pytest

from agent.errors import SocketPathRefused
from agent.metrics import AgentMetrics
from agent.peer_relay import PeerRelay
from agent.sds import SdsServer
from agent.secrets import SecretCache
from agent.unix_socket import UnixSocketPath
from agent.workload_api import WorkloadApiServer
from meshca.clock import SystemClock
from tests.support.loop import LoopThread

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
