"""The CA's roots as ClusterTrustBundles (issue 31), against the fake API server: one bundle per
root, labelled with its phase through prepare/activate/taint/revoke, foreign bundles of the
signer deleted, edited or deleted ones restored, and only the Lease holder writing. The same
against the real kube-apiserver, with the attest check, Istio's bundle, and a pod's selection
verifying every leaf: tests/k8s_real/test_trust_bundles.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ca_server.kube.trust_bundles import (
    AUTHORITY_LABEL,
    PHASE_LABEL,
    TAINTED_LABEL,
    TRUST_LABEL,
)
from tests.support.authority_cli import authority_rows, cluster_target
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE, POD_CERTIFICATE_SIGNER
from tests.support.kube_mode import CaFactory
from tests.support.metrics import sample_value
from tests.support.processes import wait_for
from tests.support.status_cli import meshca_status, status_json
from tests.support.trust_bundles import bundle_labels, selected_ids

SIGNER = POD_CERTIFICATE_SIGNER
WITHIN = 5.0


def _bundles(kube_api: KubeApiServer) -> list[dict[str, Any]]:
    return kube_api.list("clustertrustbundles")


def _phases(kube_api: KubeApiServer) -> dict[str, tuple[str, str]]:
    """authority ID → (phase, tainted) of the signer's bundles."""
    return {
        labels.get(AUTHORITY_LABEL, "?"): (
            labels.get(PHASE_LABEL, "?"),
            labels.get(TAINTED_LABEL, "?"),
        )
        for labels in bundle_labels(_bundles(kube_api), SIGNER)
    }


def _wait_phases(kube_api: KubeApiServer, wanted: dict[str, tuple[str, str]], what: str) -> None:
    wait_for(lambda: _phases(kube_api) == wanted, WITHIN, what, interval=0.1)
    assert selected_ids(_bundles(kube_api), SIGNER, {TRUST_LABEL: "true"}) == set(wanted)


def test_bundles_follow_the_rotation_and_are_restored(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    # A bundle of meshca's signer that meshca never made: it must go (a pod selecting the
    # signer would trust it).
    foreign = f"{SIGNER.replace('/', ':')}:planted"
    kube_api.create(
        "clustertrustbundles",
        {
            "metadata": {"name": foreign, "labels": {TRUST_LABEL: "true"}},
            "spec": {"signerName": SIGNER, "trustBundle": "a root nobody vouches for"},
        },
    )
    other = "example.com:other:keep"  # another signer's: not meshca's to touch
    kube_api.create(
        "clustertrustbundles",
        {
            "metadata": {"name": other},
            "spec": {"signerName": "example.com/other", "trustBundle": "x"},
        },
    )
    flags = ("--ca-reload-interval", "1s", "--pod-certificate-signer", SIGNER)
    replicas = [kube_ca(f"ca-{i}", *flags, start=False) for i in range(2)]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()
    target = cluster_target(tmp_path / "kubeconfig", CA_NAMESPACE)
    (first,) = authority_rows(target)
    old = first["id"]
    _wait_phases(kube_api, {old: ("active", "false")}, "the active root's bundle")
    names = {b["metadata"]["name"] for b in _bundles(kube_api)}
    assert foreign not in names and other in names

    # Edited (a label taken off, the root replaced) or deleted: restored.
    (mine,) = [b for b in _bundles(kube_api) if b["spec"]["signerName"] == SIGNER]
    root_pem = mine["spec"]["trustBundle"]
    mine["metadata"]["labels"] = {"team": "kept"}
    mine["spec"]["trustBundle"] = "another root"
    kube_api.update("clustertrustbundles", mine)
    wait_for(
        lambda: _phases(kube_api) == {old: ("active", "false")}, WITHIN, "the edit undone", 0.1
    )
    restored = kube_api.get("clustertrustbundles", mine["metadata"]["name"])
    assert restored["spec"]["trustBundle"] == root_pem
    assert restored["metadata"]["labels"]["team"] == "kept"
    kube_api.delete("clustertrustbundles", mine["metadata"]["name"])
    _wait_phases(kube_api, {old: ("active", "false")}, "the deleted bundle re-created")

    prepared = next(r["id"] for r in authority_rows(target, "prepare") if r["state"] == "prepared")
    _wait_phases(kube_api, {old: ("active", "false"), prepared: ("prepared", "false")}, "prepare")
    authority_rows(target, "activate", prepared)
    _wait_phases(kube_api, {old: ("old", "false"), prepared: ("active", "false")}, "activate")
    authority_rows(target, "taint", old)
    _wait_phases(kube_api, {old: ("old", "true"), prepared: ("active", "false")}, "taint")
    authority_rows(target, "revoke", old)
    _wait_phases(kube_api, {prepared: ("active", "false")}, "revoke: the bundle deleted")

    # Only the Lease holder wrote; every replica says the bundles are in step.
    writers = {
        r.user_agent
        for r in kube_api.requests()
        if r.resource == "clustertrustbundles" and r.verb in ("create", "update", "delete")
    }
    leaders = [
        ca for ca in replicas if sample_value(ca.metrics(), "meshca_ca_root_publisher_leader") == 1
    ]
    assert len(leaders) == 1 and writers == {f"meshca-ca/{leaders[0].data_dir.name}"}, writers

    def all_in_step() -> bool:
        return all(
            sample_value(ca.metrics(), "meshca_ca_trust_bundles_in_step") == 1
            and sample_value(ca.metrics(), "meshca_ca_trust_bundles_published") == 1
            for ca in replicas
        )

    wait_for(all_in_step, WITHIN, "every replica to see the bundles in step")
    for ca in replicas:  # and `meshca status` says so
        shown = status_json(ca.debug_address)["trust_bundles"]
        assert shown == {"wanted": 1, "published": 1, "in_step": True}
    table = meshca_status(replicas[0].debug_address)
    assert "ClusterTrustBundles: 1 of 1 published, in step" in table.stdout, table.stdout
