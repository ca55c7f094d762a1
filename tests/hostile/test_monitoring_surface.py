"""The monitoring ports as an attacker on the network meets them (real CA and agent processes,
real sockets): 200 idle connections leave the process's thread count bounded (Threads from
/proc/<pid>/status) and `/metrics` still served; clients that hang up mid-response leave no
traceback in the log; an idle connection is closed by the server; and the CA's monitoring port
shows no workload identities (`/debug/ca` lives on `--debug-listen` only)."""

from __future__ import annotations

import socket
import struct
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from meshca import status_http
from meshca.status_http import StatusServer, text
from tests.support.agent_process import AgentProcess
from tests.support.ca_process import CaProcess

IDLE_CONNECTIONS = 200
# The server's own threads (its loop and its fixed handler pool of 2) plus a margin for the
# daemon's threads that come and go (gRPC's, the asyncio default executor's).
THREAD_MARGIN = 8


@pytest.fixture(scope="module")
def daemons(starts_processes: None) -> Iterator[tuple[CaProcess, AgentProcess]]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mon-") as path:
        ca = CaProcess(Path(path) / "ca")
        ca.start()
        agent = AgentProcess(Path(path) / "a", ca, "mon", secret_ttl="1h")
        try:
            agent.start()
            yield ca, agent
        finally:
            agent.stop()
            ca.stop()


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("Threads:")).split()[1])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _targets(daemons: tuple[CaProcess, AgentProcess]) -> dict[str, tuple[int, int]]:
    ca, agent = daemons
    assert ca.proc is not None and agent.proc is not None
    return {
        "ca": (ca.proc.pid, ca.monitoring_port),
        "agent": (agent.proc.pid, agent.status_port),
    }


@pytest.mark.parametrize("which", ["ca", "agent"])
def test_idle_connections_leave_threads_bounded_and_the_port_serving(
    daemons: tuple[CaProcess, AgentProcess], which: str
) -> None:
    pid, port = _targets(daemons)[which]
    assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200
    before = _threads(pid)
    with ExitStack() as stack:
        for _ in range(IDLE_CONNECTIONS):
            stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
        status, body = _get(f"http://127.0.0.1:{port}/metrics")
        during = _threads(pid)
    assert status == 200 and b"meshca_" in body
    print(f"{which}: {before} threads, {during} with {IDLE_CONNECTIONS} idle connections open")
    assert during <= before + THREAD_MARGIN, f"{before} threads before, {during} with 200 idle"


@pytest.mark.parametrize("which", ["ca", "agent"])
def test_clients_that_hang_up_early_leave_no_traceback(
    daemons: tuple[CaProcess, AgentProcess], which: str
) -> None:
    ca, agent = daemons
    _, port = _targets(daemons)[which]
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, before the answer is read
    assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200  # still serving
    log = (ca if which == "ca" else agent).log()
    assert "Traceback" not in log and "BrokenPipeError" not in log, log[-3000:]


def test_the_ca_monitoring_port_shows_no_identities(
    daemons: tuple[CaProcess, AgentProcess],
) -> None:
    ca, agent = daemons
    assert _get(f"{ca.monitoring_url}/debug/ca")[0] == 404
    status, body = _get(f"{ca.monitoring_url}/metrics")
    assert status == 200 and agent.identity.encode() not in body
    status, body = _get(f"{ca.debug_url}/debug/ca")
    assert status == 200 and agent.identity.encode() in body  # the debug address has them


def test_an_idle_connection_is_closed_by_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket that never sends a request is closed after the idle timeout; the stdlib server
    waited forever (and kept a thread for it)."""
    monkeypatch.setattr(status_http, "IDLE_TIMEOUT", 0.3, raising=False)
    server = StatusServer("127.0.0.1:0", {"/healthz": lambda: text(200, "ok\n")})
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle:
            assert idle.recv(1) == b""  # closed by the server, long before our 10 s timeout
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as kept:
            kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while b"ok\n" not in answer:
                chunk = kept.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 ")
            assert kept.recv(1) == b""  # kept alive, then closed once idle
    finally:
        server.stop()


def test_connections_beyond_the_cap_evict_the_oldest_idle_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(status_http, "MAX_CONNECTIONS", 4, raising=False)
    server = StatusServer("127.0.0.1:0", {"/healthz": lambda: text(200, "ok\n")})
    server.start()
    try:
        with ExitStack() as stack:
            idle = [
                stack.enter_context(socket.create_connection(("127.0.0.1", server.port), 10))
                for _ in range(4)
            ]
            assert _get(f"{server.url}/healthz") == (200, b"ok\n")  # a fifth still gets in
            assert idle[0].recv(1) == b""  # by closing the one idle the longest
    finally:
        server.stop()
