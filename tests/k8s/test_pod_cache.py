"""The pod cache's (node, namespace, service account) index of live pods, which the node
authorizer answers from in one lookup, follows the watch: pods arrive, finish, leave."""

from __future__ import annotations

from ca_server.kube.pod_cache import PodCache
from tests.support.kube_api import KubeApiServer
from tests.support.processes import wait_for


def test_live_pods_index_follows_events(kube_api: KubeApiServer):
    kube_api.create_namespace("shop")
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="n1")
    kube_api.create_pod("shop", "cart-2", service_account="cart", node_name="n1")
    kube_api.create_pod("shop", "done-1", service_account="batch", node_name="n1", phase="Failed")
    kube_api.create_pod("shop", "pending-1", service_account="orders")
    cache = PodCache(kube_api.api_client())
    cache.start()
    try:
        assert cache.wait_synced(5)
        assert cache.runs_on_node("n1", "shop", "cart")
        assert not cache.runs_on_node("n2", "shop", "cart"), "another node"
        assert not cache.runs_on_node("n1", "other", "cart"), "another namespace"
        assert not cache.runs_on_node("n1", "shop", "batch"), "a finished pod"
        assert not cache.runs_on_node("n1", "shop", "orders"), "an unscheduled pod"

        # Scheduled later: indexed under its node once the watch delivers the update.
        kube_api.patch("pods", "pending-1", {"spec": {"nodeName": "n2"}}, namespace="shop")
        wait_for(lambda: cache.runs_on_node("n2", "shop", "orders"), 5, "orders on n2")
        # One of two replicas leaving keeps the account on the node; the second removes it.
        kube_api.delete("pods", "cart-1", namespace="shop")
        wait_for(lambda: cache.get("shop", "cart-1") is None, 5, "cart-1 deleted")
        assert cache.runs_on_node("n1", "shop", "cart")
        kube_api.patch("pods", "cart-2", {"status": {"phase": "Succeeded"}}, namespace="shop")
        wait_for(lambda: not cache.runs_on_node("n1", "shop", "cart"), 5, "cart-2 finished")
    finally:
        cache.stop()
