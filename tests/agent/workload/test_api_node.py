"""Node mode of the Workload API: callers attested by their peer credentials.

The real relay, attestor and server on a real socket; the callers are real processes running
the real py-spiffe client (`tests.support.spiffe_workload`), so `SO_PEERCRED` reports their
own pids. The two lookups the attestor makes are injected: `/proc` is a directory this test
writes (`<pid>/cgroup`, in the kubelet's systemd format, and `<pid>/stat` linked to the real
process's) and the pods are a dict by UID. Both ways the relay holds a caller (a pidfd, where
the kernel has one; its start time) run against real processes, and a caller that connects
and exits before it is inspected (`tests.support.held_connection`) is never placed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from agent.config import AgentConfig
from agent.main import Agent
from agent.secrets import TlsSecret
from agent.workload.api import REFUSED_NOT_ATTESTED
from agent.workload.attestor import NodeCaller, ProcessCgroups
from agent.workload.peer_process import SO_PEERPIDFD, PeerProcess
from certs import load_cert, load_private_key
from meshca.clock import SystemClock
from tests.support.agent_wiring import until
from tests.support.fake_ca import NODE_TOKEN, node_ca, start_fake_ca
from tests.support.fake_proc import NO_SUCH_OPTION, boot_ns, file_process, kernel_has_peer_pidfd
from tests.support.held_connection import channel_over, fetch_x509_svid, hand_over_connection
from tests.support.kube_api import KubeApiServer
from tests.support.pki import Issued, TestCa
from tests.support.processes import child_env
from tests.support.workload_api_server import Hosted, PodsByUid, node_server, pod_cgroup

pytestmark = pytest.mark.process  # every test runs Workload API clients as processes

ORDERS = "spiffe://cluster.local/ns/shop/sa/orders"
PAYMENTS = "spiffe://cluster.local/ns/shop/sa/payments"
ORDERS_POD = "5f0c8e3e-1d2b-4c6a-9e7f-0a1b2c3d4e5f"
PAYMENTS_POD = "8a9b0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d"
REFUSALS = "meshca_agent_workload_api_refusals_total"


@pytest.fixture(scope="module")
def ca() -> TestCa:
    return TestCa()


@pytest.fixture(scope="module")
def issued(ca: TestCa) -> dict[str, Issued]:
    return {
        ORDERS: ca.issue(ca.identity("orders", "shop")),
        PAYMENTS: ca.issue(ca.identity("payments", "shop")),
    }


def key_digest(issued: Issued) -> str:
    der = load_private_key(issued.key_pem).private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return hashlib.sha256(der).hexdigest()


@pytest.fixture
def node(ca: TestCa, issued: dict[str, Issued]) -> Iterator[tuple[Hosted, PodsByUid, Path]]:
    with tempfile.TemporaryDirectory(prefix="wapin", dir="/tmp") as directory:
        root = Path(directory)
        proc = root / "proc"
        proc.mkdir()
        pods = PodsByUid()
        pods.add(ORDERS_POD, "shop", "orders")
        pods.add(PAYMENTS_POD, "shop", "payments")
        with node_server(root / "api.sock", ca, issued, pods, proc) as hosted:
            yield hosted, pods, proc


HOST_CGROUP = "0::/user.slice/user-0.slice/session-1.scope\n"  # systemd's user slice, no pod


def start_workload(socket: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """A workload process (`tests.support.spiffe_workload`) waiting for its go; (it, its pid)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.spiffe_workload", str(socket), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    assert child.stdout is not None
    word, pid = child.stdout.readline().split()
    assert word == "ready"
    return child, pid


def file_cgroup(proc: Path, pid: str, pod_uid: str | None) -> None:
    """What the injected /proc says of `pid`: in `pod_uid`'s pod, or (None) in no pod; its
    stat is the real process's."""
    file_process(proc, pid, pod_cgroup(pod_uid) if pod_uid else HOST_CGROUP)


def stop_workload(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(10)


def run_workload(
    hosted: Hosted | Path, proc: Path | None, pod_uid: str | None, *extra: str
) -> list[dict[str, Any]]:
    """Starts a workload process, files its cgroup under `proc` (in `pod_uid`'s pod, or in
    none; with no `proc` its real cgroup is what the agent reads), lets it call, and returns
    its report lines."""
    socket = hosted if isinstance(hosted, Path) else hosted.socket
    child, pid = start_workload(socket, *extra)
    try:
        if proc is not None:
            file_cgroup(proc, pid, pod_uid)
        out, err = child.communicate("go\n", timeout=60)
    finally:
        stop_workload(child)
    assert child.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_two_workloads_on_one_node_socket_each_get_their_own_svid(
    node: tuple[Hosted, PodsByUid, Path], issued: dict[str, Issued]
) -> None:
    hosted, _, proc = node
    (orders,) = run_workload(hosted, proc, ORDERS_POD)
    (payments,) = run_workload(hosted, proc, PAYMENTS_POD)
    assert orders["spiffe_id"] == ORDERS
    assert orders["serial"] == issued[ORDERS].serial
    assert orders["key_sha256"] == key_digest(issued[ORDERS])
    assert payments["spiffe_id"] == PAYMENTS
    assert payments["serial"] == issued[PAYMENTS].serial
    assert payments["key_sha256"] == key_digest(issued[PAYMENTS])


def test_a_caller_in_no_known_pod_is_permission_denied(
    node: tuple[Hosted, PodsByUid, Path],
) -> None:
    hosted, pods, proc = node
    (host_process,) = run_workload(hosted, proc, None)
    assert "PERMISSION_DENIED" in host_process["details"]
    assert "runs in no Kubernetes pod" in host_process["details"]
    (stranger,) = run_workload(hosted, proc, "11111111-2222-4333-8444-555555555555")
    assert "PERMISSION_DENIED" in stranger["details"]
    assert "is not among the pods this node agent watches" in stranger["details"]
    pods.add(ORDERS_POD, "shop", "orders", phase="Succeeded")
    (ended,) = run_workload(hosted, proc, ORDERS_POD)
    assert "has ended (Succeeded)" in ended["details"]
    assert hosted.metric(REFUSALS, reason=REFUSED_NOT_ATTESTED) == 3


def test_a_workload_that_tries_never_receives_another_workloads_key(
    node: tuple[Hosted, PodsByUid, Path], issued: dict[str, Issued]
) -> None:
    """The orders workload asks for payments' SVID every way the API leaves open: metadata
    naming it, a request field carrying it, the JWT call naming it, and a connection straight
    to the gRPC server's private socket (bypassing the relay that takes peer credentials)."""
    hosted, _, proc = node
    assert hosted.server.relay is not None
    private = hosted.server.relay.private_path  # type: ignore[attr-defined]
    results = run_workload(
        hosted, proc, ORDERS_POD, "--try-as", PAYMENTS, "--private", str(private)
    )
    by_how = {result["how"]: result for result in results}
    assert len(by_how) == 8, by_how
    payments_key = key_digest(issued[PAYMENTS])
    for result in results:
        assert result.get("key_sha256") != payments_key, result
        assert result.get("spiffe_id") in (None, ORDERS), result
    served = [r for r in results if "spiffe_id" in r]
    assert len(served) == 6  # py-spiffe, four forged headers, the forged field: all orders'
    assert all(r["key_sha256"] == key_digest(issued[ORDERS]) for r in served)
    assert by_how["jwt"]["error"] == "FAILED_PRECONDITION"
    direct = by_how["private socket"]
    assert direct["error"] == "PERMISSION_DENIED"
    assert "did not come through the node agent's Workload API socket" in direct["details"]


# --- the caller is the process that connected, not its pid number -----------------------------

WAYS = {
    "pidfd": pytest.param(
        SO_PEERPIDFD,
        marks=pytest.mark.skipif(
            not kernel_has_peer_pidfd(), reason="this kernel has no SO_PEERPIDFD (Linux 6.5+)"
        ),
    ),
    "start time": NO_SUCH_OPTION,  # as on a kernel before 6.5: every kernel runs this way
}


@pytest.mark.parametrize("pidfd_option", WAYS.values(), ids=WAYS.keys())
def test_a_live_caller_is_placed_either_way(
    ca: TestCa, issued: dict[str, Issued], pidfd_option: int
) -> None:
    with tempfile.TemporaryDirectory(prefix="wapiw", dir="/tmp") as directory:
        root = Path(directory)
        proc = root / "proc"
        proc.mkdir()
        pods = PodsByUid()
        pods.add(ORDERS_POD, "shop", "orders")
        with node_server(
            root / "api.sock", ca, issued, pods, proc, pidfd_option=pidfd_option
        ) as hosted:
            (orders,) = run_workload(hosted, proc, ORDERS_POD)
    assert orders["spiffe_id"] == ORDERS
    assert orders["key_sha256"] == key_digest(issued[ORDERS])


def until_the_tick_after(moment_ns: int) -> None:
    """Waits until the boot clock is in a later clock tick than `moment_ns`'s."""
    hz = os.sysconf("SC_CLK_TCK")
    while boot_ns() * hz // 1_000_000_000 <= moment_ns * hz // 1_000_000_000:
        time.sleep(1 / hz)


class InspectionGate:
    """The relay's `before_inspect`: tells the test a caller was taken, then holds the relay
    until the test lets it inspect (the window in which a caller's pid can change hands)."""

    def __init__(self) -> None:
        self.taken = threading.Event()
        self.go = threading.Event()
        self.accepted_ns = 0

    def __call__(self, caller: PeerProcess) -> None:
        self.accepted_ns = caller.accepted_ns
        self.taken.set()
        assert self.go.wait(30), "the test never let the relay inspect its caller"


@pytest.mark.parametrize("pidfd_option", WAYS.values(), ids=WAYS.keys())
def test_a_caller_that_exits_before_it_is_inspected_is_never_placed(
    ca: TestCa, issued: dict[str, Issued], pidfd_option: int
) -> None:
    """A process of the orders pod connects, hands its connection to another (this test) and
    exits before the relay inspects it; a process of the payments pod then takes its pid
    (here: the injected /proc says so, with a real process started after the accept as the
    stat). The connection is refused, never served the payments SVID; the relay keeps
    placing live callers."""
    gate = InspectionGate()
    with tempfile.TemporaryDirectory(prefix="wapix", dir="/tmp") as directory:
        root = Path(directory)
        proc = root / "proc"
        proc.mkdir()
        pods = PodsByUid()
        pods.add(ORDERS_POD, "shop", "orders")
        pods.add(PAYMENTS_POD, "shop", "payments")
        with node_server(
            root / "api.sock",
            ca,
            issued,
            pods,
            proc,
            pidfd_option=pidfd_option,
            before_inspect=gate,
        ) as hosted:
            caller = hand_over_connection(hosted.socket)
            taker = None
            try:
                file_process(proc, caller.pid, pod_cgroup(ORDERS_POD))
                assert gate.taken.wait(30)
                caller.let_exit()
                until_the_tick_after(gate.accepted_ns)  # the taker's start is then a later tick
                taker = subprocess.Popen(
                    [sys.executable, "-c", "import time; time.sleep(60)"], text=True
                )
                file_process(proc, caller.pid, pod_cgroup(PAYMENTS_POD), stat_of=taker.pid)
                gate.go.set()
                with channel_over(caller.connection) as channel:
                    answer = fetch_x509_svid(channel)
            finally:
                gate.go.set()
                caller.close()
                if taker is not None:
                    stop_workload(taker)
            (live,) = run_workload(hosted, proc, ORDERS_POD)
            refusals = hosted.metric(REFUSALS, reason=REFUSED_NOT_ATTESTED)
    assert answer.get("error") == "PERMISSION_DENIED", answer
    expected = (
        "exited before the node agent finished inspecting it"
        if pidfd_option == SO_PEERPIDFD
        else "started after the connection was accepted"
    )
    assert expected in answer["details"] and "not placed" in answer["details"]
    assert refusals == 1
    assert live["spiffe_id"] == ORDERS


NODE = "node-1"


@pytest.fixture
def kube(starts_processes: None) -> Iterator[KubeApiServer]:
    server = KubeApiServer().start()
    server.create_namespace("shop")
    try:
        yield server
    finally:
        server.stop()


def test_the_node_agent_places_callers_with_its_own_pod_informer(kube: KubeApiServer) -> None:
    """The wired-up node Agent (`--node-mode --workload-api-socket`, pods from the API server):
    a caller whose cgroup names a pod on the node gets the scheduler's certificate for that
    pod's identity, through the informer's UID index; a process of this test host, read from
    the real /proc, is in no pod and is refused."""

    async def main(tmp: Path) -> None:
        clock = SystemClock()
        ca = node_ca(TestCa(datetime.now(UTC)), clock, delay=0)
        server, addr = await start_fake_ca(ca, tmp, clock.now())
        (tmp / "token").write_text(NODE_TOKEN)
        orders = kube.create_pod("shop", "orders-1", service_account="orders", node_name=NODE)
        config = AgentConfig(
            ca_addr=addr,
            ca_root_ca=tmp / "root-cert.pem",
            token_path=tmp / "token",
            sds_socket=tmp / "sds" / "socket",
            status_port=0,
            node_mode=True,
            node_name=NODE,
            kubeconfig=kube.write_kubeconfig(tmp / "kubeconfig"),
            workload_api_socket=tmp / "spiffe" / "socket",
            workload_api_socket_mode=0o666,
        )
        agent = Agent(config, clock=SystemClock())
        await agent.start()
        try:
            await until(lambda: agent.cache.get(ORDERS) is not None)
            socket = config.workload_api_socket
            assert socket is not None and oct(socket.stat().st_mode & 0o777) == "0o666"
            (host,) = await asyncio.to_thread(run_workload, socket, None, None)
            assert "runs in no Kubernetes pod" in host["details"], host
            # The attestor's /proc, injected: this child's cgroup names the orders pod.
            proc = tmp / "proc"
            proc.mkdir()
            caller = agent.workload_api.callers if agent.workload_api else None
            assert isinstance(caller, NodeCaller)
            caller.attestor.cgroups = ProcessCgroups(proc)
            (placed,) = await asyncio.to_thread(
                run_workload, socket, proc, orders["metadata"]["uid"]
            )
            served = agent.cache.get(ORDERS)
            assert isinstance(served, TlsSecret)
            assert placed["spiffe_id"] == ORDERS
            assert placed["serial"] == load_cert(served.cert_chain_pem).serial_number
            summary = status_summary(agent)
            assert summary["refusals"] == {REFUSED_NOT_ATTESTED: 1}
        finally:
            await agent.stop()
            await server.stop(None)
        assert not socket.exists()

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="wapik") as tmp:
        asyncio.run(main(Path(tmp)))


def status_summary(agent: Agent) -> dict[str, Any]:
    assert agent.workload_api is not None
    return agent.workload_api.summary()


def test_one_pod_cannot_take_the_stream_slots_of_the_others(
    ca: TestCa, issued: dict[str, Issued]
) -> None:
    """Past its share of streams a workload is refused (RESOURCE_EXHAUSTED, counted); the
    node's other pods are served while it holds them."""
    with tempfile.TemporaryDirectory(prefix="wapis", dir="/tmp") as directory:
        root = Path(directory)
        proc = root / "proc"
        proc.mkdir()
        pods = PodsByUid()
        pods.add(ORDERS_POD, "shop", "orders")
        pods.add(PAYMENTS_POD, "shop", "payments")
        with node_server(
            root / "api.sock", ca, issued, pods, proc, max_streams_per_caller=3
        ) as hosted:
            greedy, pid = start_workload(hosted.socket, "--hold", "4")
            try:
                assert greedy.stdout is not None and greedy.stdin is not None
                file_cgroup(proc, pid, ORDERS_POD)
                greedy.stdin.write("go\n")
                greedy.stdin.flush()
                lines = []
                while (line := greedy.stdout.readline().strip()) != "holding":
                    assert line, "the greedy workload ended early"
                    lines.append(json.loads(line))
                holds = [entry for entry in lines if entry["how"] == "hold"]
                assert [h["error"] for h in holds] == ["OK", "OK", "OK", "RESOURCE_EXHAUSTED"]
                assert "already holds 3 Workload API streams" in holds[3]["details"]
                assert hosted.stream_count() == 3
                (payments,) = run_workload(hosted, proc, PAYMENTS_POD)
                assert payments["spiffe_id"] == PAYMENTS
            finally:
                stop_workload(greedy)
            assert hosted.metric(REFUSALS, reason="too_many_streams") == 1
