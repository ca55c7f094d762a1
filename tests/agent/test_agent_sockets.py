"""Real `meshca agent` processes (against a real `meshca ca`) and the paths of their sockets:
a second agent given a live agent's SDS or Workload API socket refuses to start in one line and
leaves the first one serving; a socket left by a killed agent is taken over; an agent that
stops leaves alone a socket a successor has put at its path; and each socket closes the
connections past its cap while the clients it serves keep being served (`agent.unix_socket`).
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.unix_socket import DEFAULT_MAX_CONNECTIONS
from tests.support.agent_process import AgentProcess, run_agent_to_exit
from tests.support.ca_process import CaProcess
from tests.support.connection_flood import flood
from tests.support.processes import wait_for
from tests.support.sds_client import SECRET_TYPE_URL, fetch_secrets, leaf_serial, unpack
from tests.support.workload_api import SvidWatch, client_for

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]  # a CA and agents

PAST_THE_CAP = 16


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """Unix socket paths must stay under 107 bytes, so not pytest's long tmp_path."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mcs-") as path:
        yield Path(path)


@pytest.fixture(scope="module")
def ca(workdir: Path, starts_processes: None) -> Iterator[CaProcess]:
    ca = CaProcess(workdir / "ca")
    ca.start()
    try:
        yield ca
    finally:
        ca.stop()


def agent_with_workload_api(workdir: Path, ca: CaProcess, name: str) -> AgentProcess:
    api = workdir / name / "api.sock"
    return AgentProcess(workdir, ca, name, extra_args=("--workload-api-socket", str(api)))


def api_socket(agent: AgentProcess) -> Path:
    return agent.directory / "api.sock"


def inode(path: Path) -> tuple[int, int]:
    status = os.lstat(path)
    return status.st_dev, status.st_ino


def serves_sds(agent: AgentProcess) -> int:
    return leaf_serial(fetch_secrets(agent.sds_socket, ["default"])["default"])


def _gets_in(agent: AgentProcess) -> bool:
    """Whether a new SDS client is served now; refused (the cap still counts connections
    being closed) is False, anything else an error."""
    try:
        serves_sds(agent)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return True


def serves_workload_api(path: Path) -> str:
    client = client_for(path)
    try:
        return str(client.fetch_x509_svid().spiffe_id)
    finally:
        client.close()


def test_a_second_agent_refuses_a_live_agents_sockets_and_leaves_them_serving(
    workdir: Path, ca: CaProcess
) -> None:
    """The SDS socket used to be taken over ("removing stale SDS socket"), cutting the first
    agent's Envoy off; the Workload API socket was already refused. Both are now, the same way."""
    first = agent_with_workload_api(workdir, ca, "first")
    first.start()
    try:
        sds_before, api_before = inode(first.sds_socket), inode(api_socket(first))
        second = workdir / "second"
        second.mkdir()
        for flag, sds, api in (
            ("--sds-socket", first.sds_socket, None),
            ("--workload-api-socket", second / "sds.sock", api_socket(first)),
        ):
            result = run_agent_to_exit(second, sds, workload_api_socket=api)
            assert result.returncode == 1, result.stderr
            assert "Traceback" not in result.stderr, result.stderr
            refusals = [line for line in result.stderr.splitlines() if "ERROR" in line]
            assert len(refusals) == 1, result.stderr
            assert (
                f"{flag}: {sds if api is None else api} is a socket another process is "
                in (refusals[0])
            )
            assert not (second / "sds.sock").exists(), "the refused agent left a socket behind"
        assert inode(first.sds_socket) == sds_before, "the first agent's SDS socket was replaced"
        assert inode(api_socket(first)) == api_before
        serves_sds(first)
        assert serves_workload_api(api_socket(first)) == first.identity
        assert "PRIVATE KEY" not in first.log()
    finally:
        first.stop()


def test_the_sockets_of_a_killed_agent_are_taken_over(workdir: Path, ca: CaProcess) -> None:
    agent = agent_with_workload_api(workdir, ca, "killed")
    agent.start()
    try:
        agent.stop(signal.SIGKILL)  # no chance to remove its sockets: they stay, dead
        assert agent.sds_socket.exists() and api_socket(agent).exists()
        agent.start()
        serves_sds(agent)
        assert serves_workload_api(api_socket(agent)) == agent.identity
        for path in (agent.sds_socket, api_socket(agent)):
            assert "stale" in agent.log() and str(path) in agent.log()
    finally:
        assert agent.stop() == 0, agent.log()
    assert not agent.sds_socket.exists() and not api_socket(agent).exists()


def test_a_stopping_agent_leaves_a_successors_sockets(workdir: Path, ca: CaProcess) -> None:
    """Another process has put its own sockets at the agent's paths (it took them over while
    this agent was thought dead): the agent's stop must not remove them."""
    agent = agent_with_workload_api(workdir, ca, "replaced")
    agent.start()
    successors = []
    try:
        for path in (agent.sds_socket, api_socket(agent)):
            os.unlink(path)
            successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            successor.bind(str(path))
            successor.listen(4)
            successors.append((path, inode(path), successor))
        assert agent.stop() == 0, agent.log()
        for path, created, _ in successors:
            assert path.exists(), f"the agent removed its successor's {path.name}"
            assert inode(path) == created
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(str(path))
    finally:
        agent.stop()
        for _, _, successor in successors:
            successor.close()


def _fetch_serial(channel: grpc.Channel) -> int:
    stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
    response = stub.FetchSecrets(
        discovery_pb2.DiscoveryRequest(
            node=base_pb2.Node(id="envoy"), resource_names=["default"], type_url=SECRET_TYPE_URL
        ),
        timeout=10,
    )
    return leaf_serial(unpack(response.resources[0]))


def test_connections_past_the_cap_are_closed_and_served_clients_keep_being_served(
    workdir: Path, ca: CaProcess
) -> None:
    """The pod agent's Workload API used to hold every connection (3,000 idle ones, bounded
    only by the descriptor limit), and so did the SDS socket. Now, with an Envoy and an
    application connected first, a flood past `DEFAULT_MAX_CONNECTIONS` on each socket is
    closed at accept beyond the cap, and both clients get the next rotation (every ~4 s)."""
    agent = agent_with_workload_api(workdir, ca, "capped")
    agent.start()
    watch = SvidWatch(api_socket(agent))
    try:
        watched = watch.next(15).serial
        with grpc.insecure_channel(f"unix:{agent.sds_socket}") as envoy:
            fetched = _fetch_serial(envoy)
            count = DEFAULT_MAX_CONNECTIONS + PAST_THE_CAP
            with flood(agent.sds_socket, count) as sds, flood(api_socket(agent), count) as api:
                for held in (sds, api):
                    held.classify()
                    assert len(held.kept) <= DEFAULT_MAX_CONNECTIONS - 1, len(held.kept)
                    assert len(held.closed) >= PAST_THE_CAP + 1, len(held.closed)
                rotated = watch.next(20).serial
                while rotated == watched:
                    rotated = watch.next(20).serial
                wait_for(lambda: _fetch_serial(envoy) != fetched, 20, "the Envoy's rotation")
        # The flood gone, a new client gets in: once the agent has seen those connections
        # close (it counts them until grpc reads each close, seconds on a loaded machine).
        wait_for(lambda: _gets_in(agent), 20, "a new SDS client after the flood")
        assert agent.running
    finally:
        watch.close()
        agent.stop()
