"""The CA's cluster-wide caches (pods, ServiceAccounts) against the real API server: the state
streamed from the watch cache (watch-list) or paginated lists, one list+watch per replica
whatever `--workers`, and a CA that serves while they sync (issue 30, Done means 2 and 3).

What is counted comes from the API server's audit log, so a client that listed twice, or a
worker that listed on its own, shows up however the CA describes itself.
"""

from __future__ import annotations

import math
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc
import pytest

from ca_server.kube.pod_cache import PodCache
from tests.k8s_real.conftest import Account, RealCaFactory, unique
from tests.support.ca_process import CaProcess
from tests.support.kube_mode import audit_lines, issue, spiffe
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane

AUDIENCE = "istio-ca"


def _requests(
    plane: RealControlPlane, account: Account, resource: str
) -> list[tuple[str, dict[str, list[str]], str]]:
    """(verb, query, user agent) of each request `account` made on `resource` (a watch that
    ended has two audit events, ResponseStarted and ResponseComplete: counted once)."""
    username = f"system:serviceaccount:{account.namespace}:{account.name}"
    found = []
    counted: set[str] = set()
    for event in plane.audit_events(username):
        ref = event.get("objectRef") or {}
        if event.get("auditID") in counted:
            continue
        counted.add(event.get("auditID", ""))
        if ref.get("resource") == resource and not ref.get("name"):
            query = parse_qs(urlsplit(event["requestURI"]).query)
            found.append((event["verb"], query, event.get("userAgent", "")))
    return found


def _ready(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _issues(ca: CaProcess, token: str, identity: str) -> bool:
    try:
        return len(issue(ca, token, identity)) == 2
    except grpc.RpcError:
        return False


def _pods_in_cluster(plane: RealControlPlane) -> int:
    return len(plane.core.list_pod_for_all_namespaces().items)


@pytest.mark.parametrize("stream", [True, False], ids=["watch-list", "pages"])
def test_the_initial_state_and_the_watch_keep_the_cache_equal_to_the_cluster(
    control_plane: RealControlPlane, stream: bool
):
    shop = unique("state")
    control_plane.create_namespace(shop)
    control_plane.create_service_account(shop, "web")
    for index in range(7):
        control_plane.create_pod(shop, f"web-{index}", "web", f"node-{index % 2}")
    cache = PodCache(control_plane.admin(), page_size=3, stream_lists=stream)
    cache.start()
    try:
        assert cache.wait_synced(30)
        listed = {
            (pod.metadata.namespace, pod.metadata.name): pod.metadata.uid
            for pod in control_plane.core.list_pod_for_all_namespaces().items
        }
        assert cache.progress().objects == len(listed)
        assert all(cache.get(ns, name).uid == uid for (ns, name), uid in listed.items())  # type: ignore[union-attr]
        assert cache.runs_on_node("node-0", shop, "web")
        assert not cache.runs_on_node("node-9", shop, "web")
        # The watch: a new pod, a deleted one, and the node count following them.
        control_plane.create_pod(shop, "web-new", "web", "node-9")
        wait_for(lambda: cache.get(shop, "web-new") is not None, 10, "the new pod")
        assert cache.runs_on_node("node-9", shop, "web")
        control_plane.delete_pod(shop, "web-new")
        wait_for(lambda: cache.get(shop, "web-new") is None, 10, "the deleted pod gone")
        assert not cache.runs_on_node("node-9", shop, "web")
        assert cache.progress().objects == len(listed)
    finally:
        cache.stop()
        cache.join(5)


def test_workers_share_one_list_and_watch_of_pods_and_accounts(
    control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    """`--workers 2`: the supervisor streams the state of pods and ServiceAccounts once
    (watch-list: one watch with sendInitialEvents) and then watches them, the workers list and
    watch nothing, and the workers validate pod-bound tokens offline with its cache — a worker
    killed and restarted too, at once, without a list of its own."""
    shop = unique("shared")
    control_plane.create_namespace(shop)
    control_plane.create_service_account(shop, "cart")
    pods = [control_plane.create_pod(shop, f"cart-{i}", "cart", "node-a") for i in range(4)]
    ca = real_ca("ca-0", "--workers", "2", "--no-root-configmaps", "--token-validation", "offline")
    status, body = _ready(ca.monitoring_url)
    assert status == 200 and "pods cache: synced" in body, body
    # Enough requests, each on its own connection, that both workers answer some.
    for pod in pods * 3:
        token = control_plane.request_token(shop, "cart", audiences=(AUDIENCE,), pod=pod)
        assert len(issue(ca, token, spiffe(shop, "cart"))) == 2
    worker = _children(ca.proc.pid if ca.proc else 0)[0]
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: worker not in _children(ca.proc.pid if ca.proc else 0), 10, "the kill")
    wait_for(lambda: len(_children(ca.proc.pid if ca.proc else 0)) == 2, 30, "a new worker")
    ca.wait_ready(60)
    for pod in pods * 3:  # a new pod's token too: the restarted worker sees the latest state
        token = control_plane.request_token(shop, "cart", audiences=(AUDIENCE,), pod=pod)
        assert len(issue(ca, token, spiffe(shop, "cart"))) == 2
    late = control_plane.create_pod(shop, "cart-late", "cart", "node-a")
    token = control_plane.request_token(shop, "cart", audiences=(AUDIENCE,), pod=late)
    wait_for(lambda: _issues(ca, token, spiffe(shop, "cart")), 10, "the new pod's certificate")
    issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
    assert len(issued) == len(pods) * 6 + 1
    assert {line["authenticator"] for line in issued} == {"kubernetes-offline"}

    for resource in ("pods", "serviceaccounts"):
        calls = _requests(control_plane, ca_account, resource)
        streams = [c for c in calls if c[0] == "watch" and c[1].get("sendInitialEvents")]
        watches = [c for c in calls if c[0] == "watch" and not c[1].get("sendInitialEvents")]
        assert len(streams) == 1, (resource, calls)
        assert streams[0][1]["resourceVersionMatch"] == ["NotOlderThan"]
        assert len(watches) == 1, (resource, calls)
        assert not [c for c in calls if c[0] == "list"], (resource, calls)
        assert {c[2] for c in calls} == {streams[0][2]}, "one process streams and watches"
        assert streams[0][2].endswith("/caches"), streams[0][2]


def test_a_syncing_ca_serves_tokenreview_says_how_far_it_got_and_then_impersonation(
    control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    """A paged list (`--no-kube-stream-lists`) paced at one page a second: while it runs,
    `/ready` is 503 with the pods listed so far, a pod's token is served through TokenReview,
    and node impersonation is UNAVAILABLE with a retry hint; once synced, it is served. The
    audit log shows the pages: a list start, then `continue` pages of the size asked for."""
    shop = unique("syncing")
    control_plane.create_namespace(shop)
    control_plane.create_service_account(shop, "cart")
    control_plane.create_service_account(ca_account.namespace, "ztunnel")
    ztunnel = control_plane.create_pod(ca_account.namespace, "ztunnel-a", "ztunnel", "node-a")
    cart = control_plane.create_pod(shop, "cart-1", "cart", "node-a")
    page = max(1, math.ceil(_pods_in_cluster(control_plane) / 6))  # six pages: ~5 s at 1/s
    ca = real_ca(
        "ca-0",
        "--no-root-configmaps",
        "--token-validation",
        "offline",
        "--trusted-node-accounts",
        f"{ca_account.namespace}/ztunnel",
        "--kube-qps",
        "1",
        "--kube-burst",
        "1",
        "--kube-list-page-size",
        str(page),
        "--no-kube-stream-lists",
        start=False,
    )
    ca.launch()
    seen: list[str] = []

    def syncing() -> bool:
        status, body = _ready(ca.monitoring_url)
        if status == 503 and "listed so far" in body:
            seen.append(body)
        return status == 503 and "pods cache: syncing" in body and "serviceaccounts" in body

    wait_for(syncing, 30, "/ready saying the pod cache is syncing")
    cart_token = control_plane.request_token(shop, "cart", audiences=(AUDIENCE,), pod=cart)
    assert len(issue(ca, cart_token, spiffe(shop, "cart"))) == 2
    node_token = control_plane.request_token(
        ca_account.namespace, "ztunnel", audiences=(AUDIENCE,), pod=ztunnel
    )
    target = spiffe(shop, "cart")
    with pytest.raises(grpc.RpcError) as refused:
        issue(ca, node_token, target, metadata={"ImpersonatedIdentity": target})
    error: Any = refused.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert "pods cache: syncing" in error.details() and "retry" in error.details()
    assert dict(error.trailing_metadata()).get("grpc-retry-pushback-ms") == "2000"
    assert _ready(ca.monitoring_url)[0] == 503, "still syncing after the refusal"

    ca.wait_ready(60)
    status, body = _ready(ca.monitoring_url)
    assert status == 200 and "pods cache: synced" in body, body
    chain = issue(ca, node_token, target, metadata={"ImpersonatedIdentity": target})
    assert len(chain) == 2
    issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
    assert issued[0]["authenticator"] == "kubernetes-tokenreview"  # while syncing
    assert issued[-1]["authenticator"] == "kubernetes-offline"
    progress = [int(b.split("pods cache: syncing, ")[1].split(" ")[0]) for b in seen]
    assert progress == sorted(progress), "the count only grows"
    pages = [c for c in _requests(control_plane, ca_account, "pods") if c[0] == "list"]
    assert len([c for c in pages if "continue" not in c[1]]) == 1, pages
    assert len(pages) >= 3 and all(c[1]["limit"] == [str(page)] for c in pages), pages
