"""Done means 4: a trusted node agent (ztunnel) may get certificates for pods on its own node,
and nothing else; every denial names its reason in the audit line."""

from __future__ import annotations

import asyncio
import functools
import re

import grpc
import kubernetes.client
import pytest

from ca_server.authn import Caller
from ca_server.errors import RequestError
from ca_server.impersonation import DenyImpersonation, ImpersonationPolicy
from ca_server.kube.node_authorizer import NodeAuthorizer
from ca_server.kube.pod_cache import PodCache
from certs import SpiffeId
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, audit_lines, issue, rpc_code, spiffe
from tests.support.processes import REPO_ROOT, wait_for

STATUS_NAMES = "|".join(code.name for code in grpc.StatusCode)


def test_node_agent_impersonation(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    kube_api.create_pod(
        CA_NAMESPACE, "ztunnel-a", service_account="ztunnel", uid="zt-a", node_name="node-a"
    )
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    kube_api.create_pod("shop", "payments-1", service_account="payments", node_name="node-b")
    kube_api.create_pod(
        "shop", "done-1", service_account="batch", node_name="node-a", phase="Succeeded"
    )
    tokens = {
        "ztunnel": ("ztunnel", "ztunnel-a", "zt-a"),
        "ztunnel-stale": ("ztunnel", "ztunnel-a", "uid-of-a-deleted-pod"),
        "ztunnel-gone": ("ztunnel", "ztunnel-z", "zt-z"),
    }
    for token, (account, pod, uid) in tokens.items():
        kube_api.add_service_account_token(
            token, CA_NAMESPACE, account, audiences=["istio-ca"], pod_name=pod, pod_uid=uid
        )
    kube_api.add_service_account_token(
        "cart", "shop", "cart", audiences=["istio-ca"], pod_name="cart-1"
    )
    ca = kube_ca(
        "ca-0", "--no-root-configmaps", "--trusted-node-accounts", f"{CA_NAMESPACE}/ztunnel"
    )
    pods_listed = kube_api.count("list", "pods")

    def impersonate(token: str, target: str) -> list[str]:
        return issue(ca, token, target, metadata={"ImpersonatedIdentity": target})

    cart = spiffe("shop", "cart")
    chain = impersonate("ztunnel", cart)
    assert len(chain) == 2

    denials = {
        "impersonation-no-target-pod-on-node": ("ztunnel", spiffe("shop", "payments")),
        "impersonation-untrusted-caller": ("cart", spiffe("shop", "cart")),
        "impersonation-pod-uid-mismatch": ("ztunnel-stale", cart),
        "impersonation-caller-pod-not-found": ("ztunnel-gone", cart),
    }
    for reason, (token, target) in denials.items():
        code, details = rpc_code(functools.partial(impersonate, token, target))
        assert code == grpc.StatusCode.UNAUTHENTICATED, (reason, details)
    # A finished pod does not make its identity available on the node.
    code, _ = rpc_code(lambda: impersonate("ztunnel", spiffe("shop", "batch")))
    assert code == grpc.StatusCode.UNAUTHENTICATED

    lines = audit_lines(ca)
    issued = [line for line in lines if line["outcome"] == "issued"]
    assert issued[0]["identity"] == cart
    assert issued[0]["caller"] == f"system:serviceaccount:{CA_NAMESPACE}:ztunnel"
    denied = [line for line in lines if line["outcome"] == "denied"]
    assert [line["reason"] for line in denied[: len(denials)]] == list(denials)
    assert denied[-1]["reason"] == "impersonation-no-target-pod-on-node"
    # Decisions come from the watch-backed cache, not a GET per request.
    assert kube_api.count("get", "pods") == 0
    assert kube_api.count("list", "pods") == pods_listed

    # A pod scheduled later becomes available once the watch delivers it.
    kube_api.create_pod("shop", "orders-1", service_account="orders", node_name="node-a")

    def orders_allowed() -> bool:
        try:
            impersonate("ztunnel", spiffe("shop", "orders"))
        except grpc.RpcError:
            return False
        return True

    wait_for(orders_allowed, 2, "the new pod in the CA's pod cache")


def _refusal_status(policy: ImpersonationPolicy) -> str:
    """The status the CA answers (`RequestError.code`, translated once in ca_server.service)
    when `policy` refuses default/sleep's request for default/cart's identity."""
    caller = Caller(SpiffeId("cluster.local", "default", "sleep"), "kubernetes", "sleep")
    target = SpiffeId("cluster.local", "default", "cart")
    with pytest.raises(RequestError) as refused:
        asyncio.run(policy.authorize(caller, target))
    return refused.value.code.name


def test_the_docs_give_the_status_a_refused_impersonation_gets() -> None:
    """Every line of the docs (and README) that says which status a refused impersonation gets
    names the one the CA answers, with or without a node authorizer. Before: docs/kubernetes.md's
    troubleshooting table (and docs/security.md's refusal table) said PERMISSION_DENIED."""
    untrusted = NodeAuthorizer(
        [(CA_NAMESPACE, "ztunnel")],
        PodCache(kubernetes.client.ApiClient()),  # never started: not consulted
        "cluster.local",
        "Kubernetes",
    )
    answered = {_refusal_status(DenyImpersonation()), _refusal_status(untrusted)}
    documented: dict[str, set[str]] = {}
    for page in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if "impersonat" in line.lower():
                for status in re.findall(rf"`({STATUS_NAMES})`", line):
                    documented.setdefault(status, set()).add(f"{page.name}:{number}")
    assert answered == {"UNAUTHENTICATED"}
    assert set(documented) == answered, documented
