"""Offline token validation (`--token-validation offline`): the issuer's keys fetched once, the
bound pod and the token's ServiceAccount checked against informers, and no API call per
certificate (issue 12, Done means 3). Every token here is a real JWT signed by the fake API
server's issuer key, exactly as kubelet would project it."""

from __future__ import annotations

import time
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric import ec

from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api.issuer import DISCOVERY_PATH, JWKS_PATH
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, audit_lines, issue, rpc_code, spiffe
from tests.support.processes import wait_for

# No leader-driven writer (root ConfigMaps, istiod-tls): what is left is token validation's cost.
OFFLINE = ("--no-root-configmaps", "--no-istiod-tls", "--token-validation", "offline")
AUDIENCE = ["istio-ca"]


def _refusal(ca: CaProcess, token: str, identity: str) -> tuple[grpc.StatusCode, str]:
    return rpc_code(lambda: issue(ca, token, identity))


def test_steady_state_costs_no_api_calls(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    tokens = {}
    for index in range(20):
        pod = f"cart-{index}"
        kube_api.create_pod("shop", pod, service_account="cart", node_name="node-a")
        tokens[pod] = kube_api.issue_service_account_token(
            "shop", "cart", audiences=AUDIENCE, pod_name=pod
        )
    ca = kube_ca("ca-0", *OFFLINE)
    assert kube_api.count("get", DISCOVERY_PATH) == 1
    assert kube_api.count("get", JWKS_PATH) == 1
    kube_api.reset_counts()

    identity = spiffe("shop", "cart")
    for _ in range(2):  # new tokens, then the same tokens again (verified-token cache)
        for token in tokens.values():
            assert len(issue(ca, token, identity)) == 2
    # 40 certificates, 20 distinct tokens: not one request to the API server (the only traffic
    # allowed is a long-lived watch the CA may open late in its start-up).
    calls = {key: n for key, n in kube_api.request_counts().items() if key[0] != "watch"}
    assert calls == {}
    assert kube_api.count("watch") <= 2
    issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
    assert len(issued) == 40
    assert {line["authenticator"] for line in issued} == {"kubernetes-offline"}
    assert issued[0]["caller"] == "system:serviceaccount:shop:cart"

    # The same token is refused for another service account's identity.
    code, _ = _refusal(ca, tokens["cart-0"], spiffe("shop", "payments"))
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_bound_pod_is_checked_on_every_request(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    kube_api.create_pod("shop", "cart-2", service_account="cart", node_name="node-a")
    kube_api.create_pod("shop", "batch-1", service_account="cart", node_name="node-a")
    kube_api.create_pod("shop", "failed-1", service_account="cart", node_name="n", phase="Failed")
    kube_api.create_pod("shop", "orders-1", service_account="orders", node_name="node-a")
    ca = kube_ca("ca-0", *OFFLINE)
    identity = spiffe("shop", "cart")

    def token(pod: str, pod_uid: str | None = None) -> str:
        return kube_api.issue_service_account_token(
            "shop", "cart", audiences=AUDIENCE, pod_name=pod, pod_uid=pod_uid
        )

    live = token("cart-1")
    assert len(issue(ca, live, identity)) == 2

    refusals = {
        "token-pod-uid-mismatch": token("cart-2", pod_uid="uid-of-an-earlier-cart-2"),
        "token-pod-not-found": token("cart-9", pod_uid="uid-of-cart-9"),
        "token-pod-account-mismatch": token("orders-1"),
        "token-pod-finished": token("failed-1"),
        "token-not-pod-bound": kube_api.issue_service_account_token(
            "shop", "cart", audiences=AUDIENCE
        ),
    }
    for reason, bad in refusals.items():
        code, details = _refusal(ca, bad, identity)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (reason, details)
    denied = [line["reason"] for line in audit_lines(ca) if line["outcome"] == "denied"]
    assert denied == list(refusals)

    # A pod that finishes stops being able to get certificates.
    batch = token("batch-1")
    issue(ca, batch, identity)
    kube_api.patch("pods", "batch-1", {"status": {"phase": "Succeeded"}}, namespace="shop")
    wait_for(lambda: _refused(ca, batch, identity), timeout=10, what="finished pod refused")

    # Deleting the pod revokes its token as soon as the watch delivers the deletion, although the
    # token itself (signature, expiry) is still valid and sits in the verified-token cache.
    kube_api.delete("pods", "cart-1", namespace="shop")
    wait_for(lambda: _refused(ca, live, identity), timeout=10, what="deleted pod refused")
    code, details = _refusal(ca, live, identity)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "does not exist" in details
    # A new pod of the same name does not revive the old pod's token.
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    wait_for(lambda: _refusal(ca, live, identity)[1].find("uid") >= 0, timeout=10, what="uid")
    assert len(issue(ca, token("cart-1"), identity)) == 2
    assert kube_api.tokenreview_count == 0


def test_a_deleted_service_account_revokes_its_tokens(kube_api: KubeApiServer, kube_ca: CaFactory):
    """TokenReview refuses the token of a deleted ServiceAccount even while the pod that ran as
    it keeps running; offline validation does the same from its ServiceAccount informer, and a
    re-created account of the same name (a new uid) does not revive the old tokens."""
    kube_api.create_namespace("shop")
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    kube_api.create_pod("shop", "orders-1", service_account="orders", node_name="node-a")
    ca = kube_ca("ca-0", *OFFLINE)
    cart, orders = spiffe("shop", "cart"), spiffe("shop", "orders")

    def token(account: str, pod: str) -> str:
        return kube_api.issue_service_account_token(
            "shop", account, audiences=AUDIENCE, pod_name=pod
        )

    old_cart, orders_token = token("cart", "cart-1"), token("orders", "orders-1")
    assert len(issue(ca, old_cart, cart)) == 2  # verified, and now in the verified-token cache
    assert len(issue(ca, orders_token, orders)) == 2
    kube_api.reset_counts()

    kube_api.delete("serviceaccounts", "cart", namespace="shop")
    wait_for(lambda: _refused(ca, old_cart, cart), timeout=10, what="deleted account refused")
    code, details = _refusal(ca, old_cart, cart)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "service account shop/cart, which does not exist" in details
    assert kube_api.get("pods", "cart-1", namespace="shop") is not None  # the pod still runs
    assert len(issue(ca, orders_token, orders)) == 2  # other accounts are untouched

    # Re-created under the same name: a new object with a new uid. The old token stays
    # refused; a token kubelet projects for the new account works.
    kube_api.create_service_account("shop", "cart")
    wait_for(
        lambda: "now has uid" in _refusal(ca, old_cart, cart)[1],
        timeout=10,
        what="the old token refused for its account's uid",
    )
    assert len(issue(ca, token("cart", "cart-1"), cart)) == 2

    denied = [line["reason"] for line in audit_lines(ca) if line["outcome"] == "denied"]
    assert "token-service-account-not-found" in denied
    assert denied[-1] == "token-service-account-uid-mismatch"
    # All of it decided from the informers: no TokenReview, no other call but watches.
    assert kube_api.tokenreview_count == 0
    assert {key: n for key, n in kube_api.request_counts().items() if key[0] != "watch"} == {}


def _refused(ca: CaProcess, token: str, identity: str) -> bool:
    try:
        issue(ca, token, identity)
    except grpc.RpcError as error:
        return error.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


def test_token_claims_and_signing_keys(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    ca = kube_ca("ca-0", *OFFLINE)
    identity = spiffe("shop", "cart")
    issuer = kube_api.issuer
    pod_uid = kube_api.get("pods", "cart-1", namespace="shop")["metadata"]["uid"]
    account_uid = kube_api.get("serviceaccounts", "cart", namespace="shop")["metadata"]["uid"]

    def signed(**kwargs: Any) -> str:
        claims = {
            "audiences": AUDIENCE,
            "pod_name": "cart-1",
            "pod_uid": pod_uid,
            "service_account_uid": account_uid,
            **kwargs,
        }
        return issuer.sign("shop", "cart", **claims)

    assert len(issue(ca, signed(), identity)) == 2
    kube_api.reset_counts()
    outsider = ec.generate_private_key(ec.SECP256R1())
    refusals = {
        "jwt-expired": signed(issued_at=time.time() - 3600, lifetime=600),
        "jwt-audience": signed(audiences=["https://kubernetes.default.svc.cluster.local"]),
        "jwt-issuer": signed(issuer="https://evil.example"),
        "jwt-unknown-kid": signed(signing_key=outsider),
    }
    for reason, bad in refusals.items():
        code, details = _refusal(ca, bad, identity)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (reason, details)
    denied = [line["reason"] for line in audit_lines(ca) if line["outcome"] == "denied"]
    assert denied == list(refusals)
    # The unknown key id made the CA look for a rotated key once; a flood of further unknown
    # key ids within the refresh interval costs nothing more.
    assert kube_api.count("get", JWKS_PATH) == 1
    for _ in range(5):
        code, _ = _refusal(
            ca, signed(signing_key=ec.generate_private_key(ec.SECP256R1())), identity
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert kube_api.count("get", JWKS_PATH) == 1
    assert kube_api.tokenreview_count == 0


def test_rotated_issuer_key_is_fetched_on_first_use(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    ca = kube_ca("ca-0", *OFFLINE)
    identity = spiffe("shop", "cart")
    old = kube_api.issue_service_account_token(
        "shop", "cart", audiences=AUDIENCE, pod_name="cart-1"
    )
    issue(ca, old, identity)
    kube_api.reset_counts()

    kube_api.issuer.rotate()
    new = kube_api.issue_service_account_token(
        "shop", "cart", audiences=AUDIENCE, pod_name="cart-1"
    )
    assert len(issue(ca, new, identity)) == 2
    assert kube_api.count("get", JWKS_PATH) == 1
    issue(ca, old, identity)  # the old key is still published
    issue(ca, new, identity)
    assert kube_api.count("get", JWKS_PATH) == 1
    assert kube_api.tokenreview_count == 0


def test_node_agent_impersonation_with_offline_tokens(kube_api: KubeApiServer, kube_ca: CaFactory):
    """The node authorizer works the same on offline-validated callers (pod name and uid come
    from the token's claims instead of the TokenReview's user extra)."""
    kube_api.create_namespace("shop")
    kube_api.create_pod(
        CA_NAMESPACE, "ztunnel-a", service_account="ztunnel", uid="zt-a", node_name="node-a"
    )
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    kube_api.create_pod("shop", "payments-1", service_account="payments", node_name="node-b")
    ztunnel = kube_api.issue_service_account_token(
        CA_NAMESPACE, "ztunnel", audiences=AUDIENCE, pod_name="ztunnel-a"
    )
    ca = kube_ca("ca-0", *OFFLINE, "--trusted-node-accounts", f"{CA_NAMESPACE}/ztunnel")
    kube_api.reset_counts()

    def impersonate(target: str) -> list[str]:
        return issue(ca, ztunnel, target, metadata={"ImpersonatedIdentity": target})

    assert len(impersonate(spiffe("shop", "cart"))) == 2
    code, _ = rpc_code(lambda: impersonate(spiffe("shop", "payments")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
    assert issued[0]["identity"] == spiffe("shop", "cart")
    assert issued[0]["authenticator"] == "kubernetes-offline"
    denied = [line["reason"] for line in audit_lines(ca) if line["outcome"] == "denied"]
    assert denied == ["impersonation-no-target-pod-on-node"]
    assert {key: n for key, n in kube_api.request_counts().items() if key[0] != "watch"} == {}
