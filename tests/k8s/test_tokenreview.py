"""Done means 1: TokenReview authentication — audience and group checks, one API call per
token, rejection is UNAUTHENTICATED, an unreachable API server is UNAVAILABLE (retryable)."""

from __future__ import annotations

from pathlib import Path

import grpc

from tests.support.kube_api import KubeApiServer
from tests.support.kube_mode import CaFactory, audit_lines, issue, rpc_code, spiffe
from tests.support.metrics import sample_value


def test_tokenreview_authenticates_and_caches(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    kube_api.add_service_account_token(
        "cart-token", "shop", "cart", audiences=["istio-ca"], pod_name="cart-1", pod_uid="u-1"
    )
    ca = kube_ca("ca-0", "--no-root-configmaps")
    identity = spiffe("shop", "cart")

    chain = issue(ca, "cart-token", identity)
    assert len(chain) == 2
    assert kube_api.tokenreview_count == 1
    issue(ca, "cart-token", identity)
    assert kube_api.tokenreview_count == 1, "the second request must be served from the cache"
    metrics = ca.metrics()
    assert sample_value(metrics, "meshca_ca_tokenreview_cache_hits_total") == 1
    assert (
        sample_value(metrics, "meshca_ca_tokenreview_requests_total", {"result": "authenticated"})
        == 1
    )
    issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
    assert issued[0]["authenticator"] == "kubernetes-tokenreview"
    assert issued[0]["caller"] == "system:serviceaccount:shop:cart"

    # The API server checks the audience: a token for the API server itself is rejected.
    kube_api.add_service_account_token("api-audience-token", "shop", "cart")
    code, details = rpc_code(lambda: issue(ca, "api-audience-token", identity))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "rejected the token" in details and "audiences" in details

    code, details = rpc_code(lambda: issue(ca, "unknown-token", identity))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "token lookup failed" in details

    # Authenticated, but not a service account: a user token.
    kube_api.add_token(
        "user-token", "alice", groups=["system:authenticated"], audiences=["istio-ca"]
    )
    code, details = rpc_code(lambda: issue(ca, "user-token", identity))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "system:serviceaccounts" in details
    # In the service-account group but with a malformed username.
    kube_api.add_token(
        "odd-token",
        "system:serviceaccount:shop",
        audiences=["istio-ca"],
        groups=["system:serviceaccounts"],
    )
    code, _ = rpc_code(lambda: issue(ca, "odd-token", identity))
    assert code == grpc.StatusCode.UNAUTHENTICATED

    # A valid token cannot get another service account's identity.
    code, _ = rpc_code(lambda: issue(ca, "cart-token", spiffe("shop", "payments")))
    assert code == grpc.StatusCode.PERMISSION_DENIED

    reasons = {line.get("reason") for line in audit_lines(ca) if line["outcome"] == "denied"}
    assert {"token-rejected", "token-not-service-account"} <= reasons

    # API server unreachable: UNAVAILABLE, which clients retry; cached tokens keep working.
    kube_api.stop()
    code, details = rpc_code(lambda: issue(ca, "never-seen-token", identity))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "retry" in details
    issue(ca, "cart-token", identity)


def test_remote_cluster_tokens_are_reviewed_by_that_cluster(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    with KubeApiServer() as remote:
        remote.add_service_account_token("remote-token", "shop", "cart", audiences=["istio-ca"])
        remote_kubeconfig = remote.write_kubeconfig(tmp_path / "remote-kubeconfig")
        ca = kube_ca(
            "ca-0", "--no-root-configmaps", "--remote-kubeconfig", f"west={remote_kubeconfig}"
        )
        identity = spiffe("shop", "cart")

        issue(ca, "remote-token", identity, headers=(("clusterid", "west"),))
        assert remote.tokenreview_count == 1
        assert kube_api.tokenreview_count == 0

        # Without the header the local cluster is asked, and does not know the token.
        code, _ = rpc_code(lambda: issue(ca, "remote-token", identity))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert kube_api.tokenreview_count == 1
        code, details = rpc_code(
            lambda: issue(ca, "remote-token", identity, headers=(("clusterid", "east"),))
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "--remote-kubeconfig" in details
