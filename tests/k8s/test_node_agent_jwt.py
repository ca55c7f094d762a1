"""JWT-SVIDs in node mode, against the real CA in Kubernetes mode (the fake API server): a node
agent's Workload API (the real relay, attestor and `JwtSvidSource` with the production
`CaClient`, authenticated by the node agent's own token) serves each attested pod a JWT-SVID
for its own identity, which the CA's node authorizer checks again; py-spiffe runs in its own
process so `SO_PEERCRED` names it. A workload asking for another pod's identity is refused, the
CA refuses to impersonate a pod on another node, and the keys live in Secret `meshca-jwt-keys`,
whose change (a prepared key) reaches the agent's JWT bundle.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from agent.ca_client import CaClient
from agent.errors import CaRequestError
from agent.jwt_svids import JwtSvidSource
from agent.metrics import AgentMetrics
from agent.token import FileTokenProvider
from ca_server.authority import Phase
from ca_server.jwt_svid import JwtKeyFactory
from ca_server.jwt_svid.kube_store import KubeJwtKeyStore
from certs import SpiffeId
from meshca.clock import SystemClock
from meshca.kube_client import build_api_client
from tests.support.fake_proc import file_process
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory
from tests.support.pki import TestCa
from tests.support.processes import child_env, wait_for
from tests.support.workload_api_server import PodsByUid, node_server, pod_cgroup

NODE = "node-1"  # where PodsByUid places its pods
ORDERS = "spiffe://cluster.local/ns/shop/sa/orders"
PAYMENTS = "spiffe://cluster.local/ns/shop/sa/payments"
ORDERS_POD = "5f0c8e3e-1d2b-4c6a-9e7f-0a1b2c3d4e5f"


def _workload(socket: Path, proc: Path, pod_uid: str, *args: str) -> dict[str, Any]:
    """`tests.support.spiffe_workload` in `pod_uid`'s pod (as the injected /proc says)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.spiffe_workload", str(socket), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    try:
        assert child.stdout is not None
        word, pid = child.stdout.readline().split()
        assert word == "ready"
        file_process(proc, pid, pod_cgroup(pod_uid))
        out, err = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
    assert child.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {line["how"]: line for line in lines}


@pytest.fixture
def cluster(kube_api: KubeApiServer, kube_ca: CaFactory, tmp_path: Path) -> Iterator[Any]:
    kube_api.create_namespace("shop")
    kube_api.create_pod(
        CA_NAMESPACE, "node-agent-a", service_account="node-agent", uid="na-a", node_name=NODE
    )
    kube_api.add_service_account_token(
        "node-agent-token", CA_NAMESPACE, "node-agent", audiences=["istio-ca"],
        pod_name="node-agent-a", pod_uid="na-a",
    )  # fmt: skip
    kube_api.create_pod("shop", "orders-1", service_account="orders", uid=ORDERS_POD,
                        node_name=NODE)  # fmt: skip
    kube_api.create_pod("shop", "payments-1", service_account="payments", node_name="node-b")
    ca = kube_ca(
        "ca-0",
        "--trusted-node-accounts", f"{CA_NAMESPACE}/node-agent",
        "--ca-reload-interval", "200ms",
    )  # fmt: skip
    (tmp_path / "token").write_text("node-agent-token")
    yield ca, tmp_path


def test_a_node_agent_serves_each_pod_a_jwt_svid_for_its_own_identity(
    cluster: Any, kube_api: KubeApiServer
):
    ca, workdir = cluster
    clock = SystemClock()
    client = CaClient(
        ca.addr,
        ca.root_cert_path,
        FileTokenProvider(workdir / "token"),
        clock,
        metrics=AgentMetrics(clock),
        timeout=timedelta(seconds=5),
    )
    source = JwtSvidSource(client, clock, poll_interval=0.2)
    pods = PodsByUid()
    pods.add(ORDERS_POD, "shop", "orders")
    pki = TestCa()
    with tempfile.TemporaryDirectory(prefix="wjn", dir="/tmp") as directory:
        proc = Path(directory) / "proc"
        proc.mkdir()
        issued = {ORDERS: pki.issue(pki.identity("orders", "shop"))}
        socket = Path(directory) / "api.sock"
        with node_server(socket, pki, issued, pods, proc, jwt=source) as hosted:
            seen = _workload(hosted.socket, proc, ORDERS_POD, "--jwt", "orders-api")["jwt"]
            assert seen["spiffe_id"] == seen["validated"] == ORDERS, seen
            tried = _workload(hosted.socket, proc, ORDERS_POD, "--try-as", PAYMENTS)["jwt"]
            assert tried["error"] == "PERMISSION_DENIED", tried

            # The CA itself refuses a pod on another node, whatever the agent asks.
            async def impersonate_payments() -> None:
                await client.mint_jwt_svid(["x"], SpiffeId.parse(PAYMENTS))

            with pytest.raises(CaRequestError) as refused:
                hosted.loop.run(impersonate_payments())
            assert refused.value.code.name == "UNAUTHENTICATED", refused.value  # node authorizer

            # An operator prepares a key in the Secret: the agent's bundle gets it.
            before = hosted.loop.run(_kids(source))
            _prepare_in_secret(kube_api)
            wait_for(lambda: len(hosted.loop.run(_kids(source))) == len(before) + 1, 20,
                     "the prepared key in the node agent's JWT bundle")  # fmt: skip
            hosted.loop.run(client.close())


async def _kids(source: JwtSvidSource) -> set[str]:
    await source.refresh()
    return set(source.bundle.keys) if source.bundle is not None else set()


def _prepare_in_secret(kube_api: KubeApiServer) -> None:
    api = build_api_client(kube_api.write_kubeconfig(Path(tempfile.mkdtemp()) / "kc"), pool_size=1,
                           user_agent="test")  # fmt: skip
    try:
        factory = JwtKeyFactory("ES256", timedelta(days=1))
        store = KubeJwtKeyStore(api, CA_NAMESPACE, factory, SystemClock())
        now = datetime.now(UTC)
        store.transact(lambda s: s.prepare(lambda: factory.new(now, Phase.PREPARED), now, "test"))
    finally:
        api.close()
