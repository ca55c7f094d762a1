"""`ImpersonatedIdentity` as Istio's node agent (ztunnel) sends it: its own pod-bound
service-account token, a CSR for a workload on its node, and the request metadata
`ImpersonatedIdentity: spiffe://.../ns/<ns>/sa/<sa>`. The CA runs in Kubernetes mode against
the fake API server with the node agent's account trusted (`--trusted-node-accounts`, Istio's
`CA_TRUSTED_NODE_ACCOUNTS`)."""

from __future__ import annotations

import grpc

from certs import SpiffeId, describe_certificate, load_certs
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.istio_wire import CLUSTER_ID_HEADER, SECRET_TTL_SECONDS, istio_csr, istio_key
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, assert_verifies, audit_lines, rpc_code

NODE = "node-a"
CART = SpiffeId("cluster.local", "shop", "cart")
PAYMENTS = SpiffeId("cluster.local", "shop", "payments")


def _ztunnel_csr(ca_addr: str, root: bytes, target: SpiffeId) -> list[str]:
    with ca_stub(ca_addr, root) as stub:
        return create_certificate(
            stub,
            istio_csr(target, istio_key("ec-p256")),
            token="ztunnel-token",
            ttl_seconds=SECRET_TTL_SECONDS,
            metadata={"ImpersonatedIdentity": target.uri},
            headers=[CLUSTER_ID_HEADER],
        )


def test_a_node_agent_is_issued_the_workloads_on_its_node_only(
    kube_api: KubeApiServer, kube_ca: CaFactory
):
    kube_api.create_namespace("shop")
    kube_api.create_pod(
        CA_NAMESPACE, "ztunnel-a", service_account="ztunnel", uid="zt-a", node_name=NODE
    )
    kube_api.add_service_account_token(
        "ztunnel-token",
        CA_NAMESPACE,
        "ztunnel",
        audiences=["istio-ca"],
        pod_name="ztunnel-a",
        pod_uid="zt-a",
    )
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name=NODE)
    kube_api.create_pod("shop", "payments-1", service_account="payments", node_name="node-b")
    ca = kube_ca(
        "ca-0", "--no-root-configmaps", "--trusted-node-accounts", f"{CA_NAMESPACE}/ztunnel"
    )
    root = ca.root_cert_path.read_bytes()

    chain = _ztunnel_csr(ca.addr, root, CART)
    assert describe_certificate(load_certs(chain[0].encode())[0]).identity == CART.uri
    assert_verifies(chain, root)
    code, details = rpc_code(lambda: _ztunnel_csr(ca.addr, root, PAYMENTS))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert f"no live pod of service account shop/payments is scheduled on node {NODE}" in details

    lines = audit_lines(ca)
    issued = [line for line in lines if line.get("outcome") == "issued"]
    assert [(line["identity"], line["caller"]) for line in issued] == [
        (CART.uri, f"system:serviceaccount:{CA_NAMESPACE}:ztunnel")
    ]
    denied = [line for line in lines if line.get("outcome") == "denied"]
    assert denied[-1]["reason"] == "impersonation-no-target-pod-on-node"
