"""The node agent against the real CA in Kubernetes mode: it impersonates the workloads on its
node through the CA's node authorizer, follows pods as they come and go, and gets nothing for
pods on other nodes. Everything real: the CA and the node agent are `meshca` processes, the API
server is the fake one, reached with the real `kubernetes` client by both."""

from __future__ import annotations

import os
from pathlib import Path

from certs import describe_certificate, load_cert
from tests.support.agent_process import node_agent_args
from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, assert_verifies, audit_lines, spiffe
from tests.support.processes import MeshcaProcess, free_port, http_status, http_text, wait_for
from tests.support.sds_client import fetch_secrets, leaf_serial

NODE = "node-a"


def _identity_of(path: Path) -> str | None:
    try:
        return describe_certificate(load_cert(path.read_bytes())).identity
    except (OSError, ValueError):
        return None


def _add_node_agent_pod(kube_api: KubeApiServer) -> None:
    """The node agent's own pod on NODE, and its token `node-agent-token` (bound to that pod)."""
    kube_api.create_pod(
        CA_NAMESPACE, "node-agent-a", service_account="node-agent", uid="na-a", node_name=NODE
    )
    kube_api.add_service_account_token(
        "node-agent-token",
        CA_NAMESPACE,
        "node-agent",
        audiences=["istio-ca"],
        pod_name="node-agent-a",
        pod_uid="na-a",
    )


def test_node_agent_gets_the_identities_of_pods_on_its_node(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    kube_api.create_namespace("shop")
    _add_node_agent_pod(kube_api)
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
    kube_api.create_pod("shop", "payments-1", service_account="payments", node_name="node-b")
    ca = kube_ca(
        "ca-0", "--no-root-configmaps", "--trusted-node-accounts", f"{CA_NAMESPACE}/node-agent"
    )

    workdir = tmp_path / "node"
    workdir.mkdir()
    (workdir / "token").write_text("node-agent-token")
    status_port = free_port()
    output = workdir / "certs"
    agent = MeshcaProcess(
        node_agent_args(
            workdir,
            ca,
            NODE,
            kube_api.write_kubeconfig(workdir / "kubeconfig"),
            f"127.0.0.1:{status_port}",
        ),
        workdir / "agent.log",
    )
    agent.start()
    try:
        cart = output / "shop" / "cart" / "cert-chain.pem"
        wait_for(lambda: _identity_of(cart) == spiffe("shop", "cart"), 20, "cart's certificate")
        wait_for(
            lambda: http_status(f"http://127.0.0.1:{status_port}/healthz/ready") == 200,
            10,
            "node agent ready",
        )
        assert_verifies([cart.read_text(), ""], ca.root_cert_path.read_bytes())
        assert not (output / "shop" / "payments").exists(), "a pod on another node"

        # A pod scheduled on the node adds its identity; the last pod leaving removes it.
        kube_api.create_pod("shop", "orders-1", service_account="orders", node_name=NODE)
        orders = output / "shop" / "orders" / "cert-chain.pem"
        wait_for(lambda: _identity_of(orders) == spiffe("shop", "orders"), 20, "orders' cert")
        kube_api.delete("pods", "orders-1", namespace="shop")
        wait_for(lambda: not orders.exists(), 10, "orders' files removed")
        assert cart.exists()

        issued = {line["identity"] for line in audit_lines(ca) if line["outcome"] == "issued"}
        # Every pod on the node counts, the node agent's own pod included.
        own = spiffe(CA_NAMESPACE, "node-agent")
        assert issued == {spiffe("shop", "cart"), spiffe("shop", "orders"), own}
        callers = {line["caller"] for line in audit_lines(ca) if line["outcome"] == "issued"}
        assert callers == {f"system:serviceaccount:{CA_NAMESPACE}:node-agent"}
        assert "node-agent-token" not in agent.log() + ca.log()
    finally:
        agent.stop()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _file_serial(directory: Path) -> int | None:
    """Serial of the leaf in `directory`'s current generation (None while there is none)."""
    try:
        generation = Path(os.path.realpath(directory / "..data"))
        return int(load_cert((generation / "cert-chain.pem").read_bytes()).serial_number)
    except (FileNotFoundError, ValueError):
        return None


def test_node_agent_restarted_while_the_ca_is_down_serves_its_previous_certificates(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    """Node agent up with output files; agent stopped; CA stopped; agent started again: ready
    at once with every identity's previous serial over SDS and in its files, then new ones
    once the CA is back (restore is the scheduler's per-identity start hook, so node mode has
    it too)."""
    kube_api.create_namespace("shop")
    _add_node_agent_pod(kube_api)
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
    kube_api.create_pod("shop", "orders-1", service_account="orders", node_name=NODE)
    ca_args = ("--no-root-configmaps", "--trusted-node-accounts", f"{CA_NAMESPACE}/node-agent")
    ca = kube_ca("ca-0", *ca_args)

    workdir = tmp_path / "node"
    workdir.mkdir()
    (workdir / "token").write_text("node-agent-token")
    status = f"http://127.0.0.1:{free_port()}"
    output, socket = workdir / "certs", workdir / "sds.sock"
    # 40 s: renewals are due ~20 s after issue, after the CA-down checks below.
    agent = MeshcaProcess(
        node_agent_args(
            workdir,
            ca,
            NODE,
            kube_api.write_kubeconfig(workdir / "kubeconfig"),
            status.removeprefix("http://"),
            secret_ttl="40s",
        ),
        workdir / "agent.log",
    )
    names = {spiffe("shop", "cart"): output / "shop" / "cart"}
    names[spiffe("shop", "orders")] = output / "shop" / "orders"
    names[spiffe(CA_NAMESPACE, "node-agent")] = output / CA_NAMESPACE / "node-agent"

    def ready() -> bool:
        assert agent.running, agent.log()
        return http_status(f"{status}/healthz/ready") == 200 and socket.exists()

    def sds_serials() -> dict[str, int]:
        return {name: leaf_serial(s) for name, s in fetch_secrets(socket, list(names)).items()}

    restarted: CaProcess | None = None
    try:
        agent.start()
        wait_for(lambda: ready() and len(sds_serials()) == 3, 30, "the node agent's certificates")
        first = sds_serials()
        wait_for(lambda: all(_file_serial(d) == first[n] for n, d in names.items()), 5, "the files")
        assert agent.stop() == 0, agent.log()
        ca.stop()

        agent.start()
        wait_for(ready, 20, "the restarted node agent, with no CA running")
        assert not ca.running
        assert sds_serials() == first
        assert {n: _file_serial(d) for n, d in names.items()} == first
        metrics = http_text(f"{status}/metrics")
        assert _metric(metrics, "meshca_agent_certificate_restores_total") == 3
        assert _metric(metrics, "meshca_agent_rotations_total") == 0
        assert agent.log().count("restored from") == 3

        restarted = kube_ca("ca-0", *ca_args, start=False)  # same data dir and Secret: same root
        for flag, port in (("--listen", ca.port), ("--monitoring-listen", ca.monitoring_port)):
            restarted.args[restarted.args.index(flag) + 1] = f"127.0.0.1:{port}"
        restarted.port, restarted.monitoring_port = ca.port, ca.monitoring_port
        restarted.start()
        wait_for(
            lambda: _metric(http_text(f"{status}/metrics"), "meshca_agent_rotations_total") >= 3,
            40,
            "every identity renewed once the CA is back",
        )
        renewed = sds_serials()
        assert all(renewed[name] != first[name] for name in names)
        wait_for(
            lambda: all(_file_serial(d) == renewed[n] for n, d in names.items()),
            5,
            "the renewed files",
        )
        assert http_status(f"{status}/healthz/ready") == 200
    finally:
        code = agent.stop(timeout=5)
        if restarted is not None:
            restarted.stop()
    assert code == 0, agent.log()
    assert "PRIVATE KEY" not in agent.log() and "node-agent-token" not in agent.log()
