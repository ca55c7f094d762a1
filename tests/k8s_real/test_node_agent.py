"""The node agent and the CA's node authorizer against the real API server: real pods (bound to
a node with `spec.nodeName`, Pending without a kubelet), the node agent's real bound token, and
both components authenticated as their own ServiceAccounts with exactly deploy/'s RBAC
(tests/k8s/test_node_agent_with_ca.py runs the same against the fake server)."""

from __future__ import annotations

from pathlib import Path

from certs import describe_certificate, load_cert
from tests.k8s_real.conftest import (
    Account,
    RealCaFactory,
    assert_calls_within_contract,
    make_account,
    unique,
)
from tests.support.agent_process import node_agent_args
from tests.support.kube_api_calls import NODE_AGENT_RBAC
from tests.support.kube_mode import assert_verifies, audit_lines, spiffe
from tests.support.processes import MeshcaProcess, free_port, http_status, wait_for
from tests.support.real_kube import RealControlPlane


def _identity_of(path: Path) -> str | None:
    try:
        return describe_certificate(load_cert(path.read_bytes())).identity
    except (OSError, ValueError):
        return None


def test_node_agent_gets_the_identities_of_real_pods_on_its_node(
    tmp_path: Path, control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    node = unique("node")
    shop = unique("shop")
    control_plane.create_namespace(shop)
    # The node agent: its own ServiceAccount with deploy/node-agent's RBAC, and its pod.
    agent_account = make_account(
        control_plane,
        tmp_path / "agent-account",
        deploy_account="meshca-node-agent",
        namespace=ca_account.namespace,
    )
    agent_pod = control_plane.create_pod(
        ca_account.namespace, "node-agent-a", "meshca-node-agent", node
    )
    for account in ("cart", "payments", "orders"):
        control_plane.create_service_account(shop, account)
    control_plane.create_pod(shop, "cart-1", "cart", node)
    control_plane.create_pod(shop, "payments-1", "payments", unique("other-node"))
    trusted = f"{ca_account.namespace}/meshca-node-agent"
    ca = real_ca("ca-0", "--no-root-configmaps", "--trusted-node-accounts", trusted)

    workdir = tmp_path / "node"
    workdir.mkdir()
    token = control_plane.request_token(
        ca_account.namespace, "meshca-node-agent", audiences=("istio-ca",), pod=agent_pod
    )
    (workdir / "token").write_text(token)
    status_port = free_port()
    output = workdir / "certs"
    agent = MeshcaProcess(
        node_agent_args(workdir, ca, node, agent_account.kubeconfig, f"127.0.0.1:{status_port}"),
        workdir / "agent.log",
    )
    agent.start()
    try:
        cart = output / shop / "cart" / "cert-chain.pem"
        wait_for(lambda: _identity_of(cart) == spiffe(shop, "cart"), 30, "cart's certificate")
        wait_for(
            lambda: http_status(f"http://127.0.0.1:{status_port}/healthz/ready") == 200,
            10,
            "node agent ready",
        )
        assert_verifies([cart.read_text(), ""], ca.root_cert_path.read_bytes())
        assert not (output / shop / "payments").exists(), "a pod on another node"

        # A pod bound to the node adds its identity; the last pod leaving removes it.
        control_plane.create_pod(shop, "orders-1", "orders", node)
        orders = output / shop / "orders" / "cert-chain.pem"
        wait_for(lambda: _identity_of(orders) == spiffe(shop, "orders"), 30, "orders' cert")
        control_plane.delete_pod(shop, "orders-1")
        wait_for(lambda: not orders.exists(), 15, "orders' files removed")
        assert cart.exists()

        issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
        own = spiffe(ca_account.namespace, "meshca-node-agent")
        assert {line["identity"] for line in issued} == {
            spiffe(shop, "cart"),
            spiffe(shop, "orders"),
            own,
        }
        # The caller is what the real TokenReview said the token belongs to.
        assert {line["caller"] for line in issued} == {
            f"system:serviceaccount:{ca_account.namespace}:meshca-node-agent"
        }
        assert token not in agent.log() + ca.log()
        assert_calls_within_contract(control_plane, agent_account, NODE_AGENT_RBAC)
    finally:
        agent.stop()
        agent_account.rbac.delete(control_plane)
