"""Coverage across replicas (issue #9): each replica publishes the agent reports it received in
its `meshca-ca-replica-<instance>` ConfigMap (`agents.json`), and `meshca authority show` merges
them — a pod that renewed through both replicas counts once, with its latest bundle. Each
report counts for the pod its token is bound to (TokenReview's `extra`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from agent.propagation import AGENT_ID_HEADER, TRUST_BUNDLE_HEADER
from agent.trust_bundle import bundle_digest
from ca_server.authority.slots import authority_id
from ca_server.kube.replica_reports import report_name
from certs import load_certs
from tests.support.authority_cli import authority_rows, cluster_target, meshca_authority
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, issue, spiffe
from tests.support.processes import wait_for
from tests.support.status_cli import status_json


def _coverage(kubeconfig: Path) -> tuple[dict[str, tuple[int, int]], Any]:
    result = meshca_authority(cluster_target(kubeconfig, CA_NAMESPACE), "show", "-o", "json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    fractions = {
        row["id"]: (row["agents_trusting"], row["agents_reporting"]) for row in shown["authorities"]
    }
    return fractions, shown["agents_unknown"]


def test_show_merges_the_agent_reports_of_every_replica(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
) -> None:
    for pod in ("pod-a", "pod-b", "pod-c"):
        kube_api.add_service_account_token(
            f"token-{pod}",
            "default",
            "cart",
            audiences=["istio-ca"],
            pod_name=pod,
            pod_uid=f"uid-{pod}",
        )
    kube_api.add_service_account_token("istio-token", "default", "istio", audiences=["istio-ca"])
    replicas = [kube_ca(f"ca-{i}", "--ca-reload-interval", "200ms", start=False) for i in range(2)]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()
    kubeconfig = tmp_path / "kubeconfig"
    assert meshca_authority(cluster_target(kubeconfig, CA_NAMESPACE), "prepare").returncode == 0
    wait_for(
        lambda: all(len(load_certs(ca.root_cert_path.read_bytes())) == 2 for ca in replicas),
        10,
        "both replicas to publish {A, B}",
    )
    states = {
        row["state"]: row["id"] for row in authority_rows(cluster_target(kubeconfig, CA_NAMESPACE))
    }
    old, new = states["active"], states["prepared"]
    roots = {authority_id(r): r for r in load_certs(replicas[0].root_cert_path.read_bytes())}
    both, old_only = bundle_digest(roots.values()), bundle_digest([roots[old]])
    cart = spiffe("default", "cart")

    def report(replica: int, pod: str, digest: str) -> None:
        headers = ((AGENT_ID_HEADER, f"agent-{replica}"), (TRUST_BUNDLE_HEADER, digest))
        issue(replicas[replica], f"token-{pod}", cart, headers=headers)

    report(0, "pod-a", old_only)
    report(1, "pod-b", both)
    report(0, "pod-c", old_only)
    report(1, "pod-c", both)  # pod-c got the new root and renewed through the other replica
    issue(replicas[1], "istio-token", spiffe("default", "istio"))  # no report: unknown

    expected = ({old: (3, 3), new: (2, 3)}, 1)
    deadline = time.monotonic() + 10  # each replica publishes within a poll
    while _coverage(kubeconfig) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _coverage(kubeconfig) == expected
    published = {
        cm["metadata"]["name"]
        for cm in kube_api.list("configmaps", namespace=CA_NAMESPACE)
        if "agents.json" in (cm.get("data") or {})
    }
    assert published == {report_name("ca-0"), report_name("ca-1")}

    # `meshca status` shows the same merged view: from the cluster, and from either replica's
    # monitoring address (each reads every replica's report at every poll).
    shown = json.loads(
        meshca_authority(cluster_target(kubeconfig, CA_NAMESPACE), "show", "-o", "json").stdout
    )
    from_cluster = status_json(*cluster_target(kubeconfig, CA_NAMESPACE))
    assert from_cluster["kind"] == "ca-state" and CA_NAMESPACE in from_cluster["source"]
    assert from_cluster["authorities"] == shown["authorities"]
    assert from_cluster["coverage"]["agents_reporting"] == 3
    for ca in replicas:
        address = ca.debug_address

        def merged(address: str = address) -> bool:
            return status_json(address)["authorities"] == shown["authorities"]

        wait_for(merged, 10, f"{address}'s /debug/ca to show the merged coverage")
