"""Pure parts of Kubernetes mode: review cache expiry/bounds, token bucket, TokenReview status
interpretation, CA_TRUSTED_NODE_ACCOUNTS parsing, the node authorizer's cluster check."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import cast

import jwt
import pytest

from ca_server.authn import Caller
from ca_server.errors import AuthenticationError
from ca_server.kube.node_authorizer import NodeAuthorizer
from ca_server.kube.pod_cache import PodCache
from ca_server.kube.ratelimit import AsyncTokenBucket
from ca_server.kube.tokenreview import POD_NAME_KEY, POD_UID_KEY, caller_from_review
from ca_server.token_cache import VerifiedTokenCache, token_digest, token_expiry
from certs import SpiffeId
from meshca.clock import FakeClock

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def test_review_cache_honours_token_exp_cap_and_size():
    cache: VerifiedTokenCache[str] = VerifiedTokenCache(max_entries=2, max_ttl=timedelta(minutes=5))
    cache.put("a", "A", NOW, NOW + timedelta(seconds=30))
    cache.put("b", "B", NOW, None)
    assert cache.get("a", NOW + timedelta(seconds=29)) == "A"
    assert cache.get("a", NOW + timedelta(seconds=30)) is None
    assert cache.get("b", NOW + timedelta(minutes=4)) == "B"
    assert cache.get("b", NOW + timedelta(minutes=5)) is None
    cache.put("c", "C", NOW, None)
    cache.put("d", "D", NOW, None)
    cache.put("e", "E", NOW, None)
    assert len(cache) == 2 and cache.get("c", NOW) is None
    cache.put("expired", "X", NOW, NOW - timedelta(seconds=1))
    assert cache.get("expired", NOW) is None


def test_token_expiry_and_digest():
    exp = int(NOW.timestamp())
    token = jwt.encode({"exp": exp}, "secret-key-of-at-least-32-bytes!!", algorithm="HS256")
    assert token_expiry(token) == NOW
    assert token_expiry("opaque") is None
    assert token_digest("c1", "t") != token_digest("c2", "t")


def test_token_bucket_allows_burst_then_paces():
    clock = FakeClock()
    bucket = AsyncTokenBucket(rate=10, burst=2, clock=clock)
    assert [bucket.reserve() for _ in range(2)] == [0.0, 0.0]
    assert bucket.reserve() == pytest.approx(0.1)
    assert bucket.reserve() == pytest.approx(0.2)
    clock.advance(1.0)
    assert bucket.reserve() == 0.0
    with pytest.raises(ValueError):
        AsyncTokenBucket(rate=0, burst=1, clock=clock)


def test_spare_tokens_leave_half_the_burst_and_never_reserve_a_slot():
    """What agent reports spend: a token only while half the burst stays in the bucket, so a
    certificate request arriving next never waits behind them."""
    clock = FakeClock()
    bucket = AsyncTokenBucket(rate=10, burst=4, clock=clock)
    assert [bucket.take_spare() for _ in range(2)] == [0.0, 0.0]
    assert bucket.take_spare() == pytest.approx(0.1)  # 2 left: none spare, nothing taken
    assert bucket.take_spare() == pytest.approx(0.1)
    assert [bucket.reserve() for _ in range(2)] == [0.0, 0.0]  # certificates: the other half
    assert bucket.take_spare() == pytest.approx(0.3)
    clock.advance(0.3)
    assert bucket.take_spare() == 0.0
    # A bucket of one: its token is spare only when full (nothing to keep back).
    single = AsyncTokenBucket(rate=1, burst=1, clock=clock)
    assert single.take_spare() == 0.0
    assert single.take_spare() == pytest.approx(1.0)


def _status(
    authenticated=True,
    username="system:serviceaccount:shop:cart",
    groups=("system:serviceaccounts",),
    extra=None,
    error=None,
):
    user = SimpleNamespace(username=username, groups=list(groups), extra=extra)
    return SimpleNamespace(authenticated=authenticated, user=user, error=error)


def test_caller_from_review():
    caller = caller_from_review(
        _status(extra={POD_NAME_KEY: ["cart-1"], POD_UID_KEY: ["u1"]}), "cluster.local", "K"
    )
    assert caller.identity.uri == "spiffe://cluster.local/ns/shop/sa/cart"
    assert (caller.pod_name, caller.pod_uid) == ("cart-1", "u1")
    rejections = {
        "token-rejected": _status(authenticated=False, error="expired"),
        "token-not-service-account": _status(groups=("system:authenticated",)),
    }
    for reason, status in rejections.items():
        with pytest.raises(AuthenticationError) as info:
            caller_from_review(status, "cluster.local", "K")
        assert info.value.reason == reason
    for username in ("alice", "system:serviceaccount:shop", "system:serviceaccount:a:b:c"):
        with pytest.raises(AuthenticationError):
            caller_from_review(_status(username=username), "cluster.local", "K")


def test_node_authorizer_refuses_node_agents_of_remote_clusters():
    # The pod cache holds only this cluster's pods, so a remote caller is refused before it.
    authorizer = NodeAuthorizer(
        [("istio-system", "ztunnel")], cast(PodCache, None), "cluster.local", "Kubernetes"
    )
    caller = Caller(
        SpiffeId("cluster.local", "istio-system", "ztunnel"),
        "tokenreview",
        subject="system:serviceaccount:istio-system:ztunnel",
        pod_name="ztunnel-a",
        pod_uid="uid-a",
        extra={"cluster_id": "west"},
    )
    target = SpiffeId("cluster.local", "shop", "cart")
    with pytest.raises(AuthenticationError) as refused:
        asyncio.run(authorizer.authorize(caller, target))
    assert refused.value.reason == "impersonation-remote-cluster"
    assert "cluster west" in refused.value.message
