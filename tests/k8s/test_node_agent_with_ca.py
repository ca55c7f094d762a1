"""The node agent against the real CA in Kubernetes mode: it impersonates the workloads on its
node through the CA's node authorizer, follows pods as they come and go, and gets nothing for
pods on other nodes. Everything real: the CA and the node agent are `meshca` processes, the API
server is the fake one, reached with the real `kubernetes` client by both."""

from __future__ import annotations

from pathlib import Path

from certs import describe_certificate, load_cert
from tests.k8s.conftest import CA_NAMESPACE, CaFactory, assert_verifies, audit_lines, spiffe
from tests.support.kube_api import KubeApiServer
from tests.support.processes import MeshcaProcess, free_port, http_status, wait_for

NODE = "node-a"


def _identity_of(path: Path) -> str | None:
    try:
        return describe_certificate(load_cert(path.read_bytes())).identity
    except (OSError, ValueError):
        return None


def test_node_agent_gets_the_identities_of_pods_on_its_node(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    kube_api.create_namespace("shop")
    kube_api.create_pod(
        CA_NAMESPACE, "node-agent-a", service_account="node-agent", uid="na-a", node_name=NODE
    )
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
    kube_api.create_pod("shop", "payments-1", service_account="payments", node_name="node-b")
    kube_api.add_service_account_token(
        "node-agent-token",
        CA_NAMESPACE,
        "node-agent",
        audiences=["istio-ca"],
        pod_name="node-agent-a",
        pod_uid="na-a",
    )
    ca = kube_ca(
        "ca-0", "--no-root-configmaps", "--trusted-node-accounts", f"{CA_NAMESPACE}/node-agent"
    )

    workdir = tmp_path / "node"
    workdir.mkdir()
    (workdir / "token").write_text("node-agent-token")
    status_port = free_port()
    output = workdir / "certs"
    agent = MeshcaProcess(
        [
            "agent",
            "--node-mode",
            "--node-name",
            NODE,
            "--kubeconfig",
            str(kube_api.write_kubeconfig(workdir / "kubeconfig")),
            "--ca-addr",
            ca.addr,
            "--ca-root",
            str(ca.root_cert_path),
            "--token-file",
            str(workdir / "token"),
            "--sds-socket",
            str(workdir / "sds.sock"),
            "--output-dir",
            str(output),
            "--status-listen",
            f"127.0.0.1:{status_port}",
            "--secret-ttl",
            "1h",
        ],
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
