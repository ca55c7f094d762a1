"""Issue #17 Done means 2 (Kubernetes mode): a rollout replaces 1,000 pods; coverage counts
only the live pods within one informer delay — a deleted pod's report stops counting when the
watch delivers the deletion, not when it expires. A real CA (offline token validation, so it
runs the pod informer) against the test API server; each pod reports over the real RPC with a
token bound to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc

from agent.trust_bundle import bundle_digest
from certs import load_certs
from meshca_proto import report_pb2
from tests.support.authority_cli import cluster_target, meshca_authority
from tests.support.ca_client import report_channel, send_report
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory
from tests.support.processes import wait_for

PODS = 1000
WAVE = 250  # the rollout replaces this many pods at a time (maxSurge)
INFORMER_DELAY = 15.0  # generous bound: a watch event plus a publication (200 ms polls)


def _serving(kubeconfig: Path, authority: str) -> dict[str, Any]:
    result = meshca_authority(
        cluster_target(kubeconfig, CA_NAMESPACE), "show", authority, "--agents", "-o", "json"
    )
    assert result.returncode == 0, result.stderr
    listing: dict[str, Any] = json.loads(result.stdout)["agents"]
    return listing


def test_a_rollout_of_1000_pods_leaves_only_the_live_ones_counted(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
) -> None:
    kube_api.create_namespace("shop")
    ca = kube_ca(
        "ca-0",
        "--no-root-configmaps",
        "--token-validation",
        "offline",
        "--ca-reload-interval",
        "200ms",
    )
    kubeconfig = tmp_path / "kubeconfig"
    (root,) = load_certs(ca.root_cert_path.read_bytes())
    digest = bundle_digest([root])
    active = json.loads(
        meshca_authority(cluster_target(kubeconfig, CA_NAMESPACE), "show", "-o", "json").stdout
    )["authorities"][0]["id"]

    def create(pods: list[str]) -> dict[str, str]:
        tokens = {}
        for pod in pods:
            kube_api.create_pod("shop", pod, service_account="web", node_name="node-a")
            tokens[pod] = kube_api.issue_service_account_token(
                "shop", "web", audiences=["istio-ca"], pod_name=pod
            )
        return tokens

    def report(tokens: dict[str, str], channel: Any) -> None:
        """Each pod's agent reports once the CA's informer knows its pod (as a real agent
        retries an UNAUTHENTICATED report)."""
        for pod, token in tokens.items():
            request = report_pb2.AgentReportRequest(
                agent_id=f"agent-{pod}", trust_bundle_sha256=digest, leaf_authorities=[active]
            )

            def sent(request: report_pb2.AgentReportRequest = request, token: str = token) -> bool:
                try:
                    send_report(channel, request, token=token)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                    return False
                return True

            wait_for(sent, INFORMER_DELAY, f"{pod}'s report", interval=0.1)

    def counted() -> set[str]:
        serving = _serving(kubeconfig, active)["authorities"][0]["serving"]
        pods = {row["pod"] for row in serving["pods"]}
        return pods | {"(more than listed)"} if serving["not_listed"] else pods

    old = [f"web-old-{n}" for n in range(PODS)]
    new = [f"web-new-{n}" for n in range(PODS)]
    with report_channel(ca.addr, ca.root_cert_path.read_bytes()) as channel:
        report(create(old), channel)
        wait_for(lambda: len(counted()) == PODS, 30, "the first 1,000 pods")
        for first in range(0, PODS, WAVE):
            report(create(new[first : first + WAVE]), channel)
            for pod in old[first : first + WAVE]:
                kube_api.delete("pods", pod, namespace="shop")
    wanted = {f"shop/{pod}" for pod in new}
    wait_for(lambda: counted() == wanted, INFORMER_DELAY, "only the live pods counted")
    listing = _serving(kubeconfig, active)
    assert listing["reporting"] == PODS and listing["unseen"] == 0
    assert {row["node"] for row in listing["authorities"][0]["serving"]["pods"]} == {"node-a"}
