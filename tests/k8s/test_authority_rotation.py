"""Done means 4 (Kubernetes mode): two CA replicas sharing the authority slots in Secret
`istio-ca-secret` agree on every phase within 5 s of a change made with `meshca authority`
against the cluster, and after `taint` neither signs with (or trusts) the tainted authority."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from cryptography import x509

from ca_server.authority.slots import authority_id
from ca_server.kube.replica_reports import LABELS as REPORT_LABELS
from ca_server.kube.replica_reports import report_name
from ca_server.kube.root_publisher import CONFIGMAP_NAME
from ca_server.kube.secret_root import SECRET_NAME
from certs import load_cert, load_certs
from tests.support.authority_cli import authority_rows, cluster_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, assert_verifies, issue, spiffe
from tests.support.metrics import sample_value
from tests.support.processes import wait_for

CONVERGE_WITHIN = 5.0


def authority(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return meshca_authority(cluster_target(kubeconfig, CA_NAMESPACE), *args)


def rows(kubeconfig: Path, *args: str) -> list[dict[str, Any]]:
    return authority_rows(cluster_target(kubeconfig, CA_NAMESPACE), *args)


def signer_of(chain: list[str]) -> str:
    leaf = load_cert(chain[0].encode())
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier is not None
    return aki.key_identifier.hex()


def bundle_ids(ca: CaProcess) -> set[str]:
    return {authority_id(c) for c in load_certs(ca.root_cert_path.read_bytes())}


def root_configmaps(kube_api: KubeApiServer) -> list[dict[str, Any]]:
    return [cm for cm in kube_api.list("configmaps") if cm["metadata"]["name"] == CONFIGMAP_NAME]


def converged(what: str, check: Any) -> float:
    """Waits for `check()`; returns how long it took (must be within CONVERGE_WITHIN)."""
    started = time.monotonic()
    wait_for(check, CONVERGE_WITHIN, what, interval=0.1)
    return time.monotonic() - started


def test_two_replicas_follow_prepare_activate_taint_revoke_within_5s(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    kube_api.add_service_account_token("cart-token", "default", "cart", audiences=["istio-ca"])
    replicas = [kube_ca(f"ca-{i}", "--ca-reload-interval", "1s", start=False) for i in range(2)]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()
    kubeconfig = tmp_path / "kubeconfig"
    (first,) = rows(kubeconfig, "show")
    assert first["state"] == "active"
    old = first["id"]
    # A replica that is gone left a report whose leaves have all expired: it gets swept.
    kube_api.create(
        "configmaps",
        {
            "metadata": {
                "name": report_name("ca-gone"),
                "namespace": CA_NAMESPACE,
                "labels": dict(REPORT_LABELS),
            },
            "data": {"leaves.json": json.dumps({old: {"1000": 7}})},
        },
    )
    for ca in replicas:
        assert signer_of(issue(ca, "cart-token", spiffe("default", "cart"))) == old
    # show sums the live leaves every replica reports (each publishes within a poll).
    wait_for(lambda: rows(kubeconfig)[0]["live_leaves"] == 2, 10, "both replicas' reports")
    reports = {
        cm["metadata"]["name"]
        for cm in kube_api.list("configmaps", namespace=CA_NAMESPACE)
        if cm["metadata"]["name"].startswith("meshca-ca-replica-")
    }
    assert reports == {report_name("ca-0"), report_name("ca-1")}, "the gone one is swept"

    # prepare: both replicas publish {old, new} (root-cert.pem and the ConfigMaps).
    prepared = next(r["id"] for r in rows(kubeconfig, "prepare") if r["state"] == "prepared")
    took = converged(
        "both replicas to publish the prepared authority",
        lambda: all(bundle_ids(ca) == {old, prepared} for ca in replicas),
    )
    print(f"prepare reached both replicas in {took:.2f}s")
    wait_for(
        lambda: all(
            {authority_id(c) for c in load_certs(cm["data"]["root-cert.pem"].encode())}
            == {old, prepared}
            for cm in root_configmaps(kube_api)
        ),
        15,
        "the root ConfigMaps to carry both authorities",
    )
    secret = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE)
    root_pem = base64.b64decode(secret["data"]["root-cert.pem"])
    assert {authority_id(c) for c in load_certs(root_pem)} == {old, prepared}
    assert authority_id(load_cert(base64.b64decode(secret["data"]["ca-cert.pem"]))) == old

    # activate: both replicas sign with the new authority.
    rows(kubeconfig, "activate", prepared)
    took = converged(
        "both replicas to sign with the activated authority",
        lambda: all(
            signer_of(issue(ca, "cart-token", spiffe("default", "cart"))) == prepared
            for ca in replicas
        ),
    )
    print(f"activate reached both replicas in {took:.2f}s")

    # taint the old one: every replica marks it at once and never signs with it.
    rows(kubeconfig, "taint", old)
    took = converged(
        "both replicas to see the taint",
        lambda: all(
            sample_value(ca.metrics(), "meshca_ca_authority_tainted", {"authority": old}) == 1
            for ca in replicas
        ),
    )
    print(f"taint reached both replicas in {took:.2f}s")
    for ca in replicas:
        for _ in range(5):
            chain = issue(ca, "cart-token", spiffe("default", "cart"))
            assert signer_of(chain) == prepared
            assert_verifies(chain, ca.root_cert_path.read_bytes())

    # revoke: the old authority leaves every bundle.
    assert rows(kubeconfig, "revoke", old)[0]["id"] == prepared
    took = converged(
        "both replicas to drop the revoked authority",
        lambda: all(bundle_ids(ca) == {prepared} for ca in replicas),
    )
    print(f"revoke reached both replicas in {took:.2f}s")
    wait_for(
        lambda: all(
            {authority_id(c) for c in load_certs(cm["data"]["root-cert.pem"].encode())}
            == {prepared}
            for cm in root_configmaps(kube_api)
        ),
        15,
        "the root ConfigMaps to drop the revoked authority",
    )


def test_refusals_through_the_cluster_change_nothing(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    kube_ca("ca-0", "--ca-reload-interval", "1s")
    kubeconfig = tmp_path / "kubeconfig"
    (active,) = rows(kubeconfig, "show")
    before = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE)["metadata"]
    result = authority(kubeconfig, "taint", active["id"])
    assert result.returncode == 3
    assert "is active" in result.stderr and "prepare" in result.stderr
    result = authority(kubeconfig, "activate")
    assert result.returncode == 3 and "no prepared authority" in result.stderr
    after = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE)["metadata"]
    assert after["resourceVersion"] == before["resourceVersion"]
