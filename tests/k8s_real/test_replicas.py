"""Two CA replicas against the real API server: the race to create Secret `istio-ca-secret`
(the real server's 409 AlreadyExists decides it), ConfigMap `istio-ca-root-cert` in every
namespace with self-healing through real watches, and the Lease deciding the one writer, with
failover. tests/k8s/test_shared_root.py and test_root_configmaps.py run the same against the
fake server (which also injects the faults a real server cannot be made to show)."""

from __future__ import annotations

import base64
from collections import Counter
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from ca_server.kube.root_publisher import CONFIGMAP_NAME
from ca_server.kube.secret_root import SECRET_NAME, SECRET_TYPE
from tests.k8s_real.conftest import Account, RealCaFactory, unique
from tests.support.ca_process import CaProcess
from tests.support.kube_mode import assert_verifies, issue, spiffe
from tests.support.metrics import sample_value
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane

SKIPPED_NAMESPACES = {"kube-public", "kube-node-lease"}


def _published(plane: RealControlPlane, namespace: str, root: str) -> bool:
    try:
        cm = plane.core.read_namespaced_config_map(CONFIGMAP_NAME, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return (cm.data or {}).get("root-cert.pem") == root and (cm.metadata.labels or {}).get(
        "istio.io/config"
    ) == "true"


def _namespaces(plane: RealControlPlane) -> set[str]:
    return {ns.metadata.name for ns in plane.core.list_namespace().items}


def _leader(replicas: list[CaProcess]) -> CaProcess:
    def leaders() -> list[CaProcess]:
        return [
            ca for ca in replicas
            if sample_value(ca.metrics(), "meshca_ca_root_publisher_leader") == 1
        ]  # fmt: skip

    wait_for(lambda: len(leaders()) == 1, 20, "exactly one leader")
    return leaders()[0]


def _writers(plane: RealControlPlane, account: Account) -> Counter[str]:
    """Which replica (user agent meshca-ca/<name>) wrote root ConfigMaps, per the audit log."""
    username = f"system:serviceaccount:{account.namespace}:{account.name}"
    return Counter(
        event["userAgent"].split(" ")[0]
        for event in plane.audit_events(username)
        if event["verb"] in ("create", "update", "patch", "delete")
        and (event.get("objectRef") or {}).get("resource") == "configmaps"
        and (event.get("objectRef") or {}).get("name") == CONFIGMAP_NAME
        and event.get("stage") == "ResponseComplete"
    )


def test_two_replicas_race_to_one_root_secret(
    control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    shop = unique("shop")
    control_plane.create_namespace(shop)
    control_plane.create_service_account(shop, "cart")
    pod = control_plane.create_pod(shop, "cart-1", "cart")
    token = control_plane.request_token(shop, "cart", audiences=("istio-ca",), pod=pod)
    # --no-istiod-tls: the root's is the one Secret (and Secret create) this test counts.
    replicas = [
        real_ca(
            f"ca-{i}",
            *("--no-root-configmaps", "--no-istiod-tls", "--ca-reload-interval", "200ms"),
            start=False,
        )
        for i in range(2)
    ]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()

    listed = control_plane.core.list_namespaced_secret(ca_account.namespace).items
    # The root's Secret and the JWT-SVID keys' (one key for every replica too).
    assert sorted(s.metadata.name for s in listed) == sorted([SECRET_NAME, "meshca-jwt-keys"])
    secrets = [s for s in listed if s.metadata.name == SECRET_NAME]
    assert secrets[0].type == SECRET_TYPE
    root = base64.b64decode(secrets[0].data["root-cert.pem"])
    creates = [
        e
        for e in control_plane.audit_events(f"system:serviceaccount:{ca_account.namespace}:meshca")
        if e["verb"] == "create" and (e.get("objectRef") or {}).get("resource") == "secrets"
    ]
    # One create of each Secret won; a replica that also tried got the real server's 409 and
    # adopted the winner's.
    assert [e["responseStatus"]["code"] for e in creates].count(201) == 2
    assert all(e["responseStatus"]["code"] in (201, 409) for e in creates)
    for ca in replicas:
        assert ca.root_cert_path.read_bytes() == root
        chain = issue(ca, token, spiffe(shop, "cart"))
        assert chain[-1].encode() == root
        assert_verifies(chain, root)


def test_root_configmaps_everywhere_heal_and_follow_the_lease(
    control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    shop = unique("shop")
    control_plane.create_namespace(shop)
    replicas = [real_ca(f"ca-{i}", start=False) for i in range(2)]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()
    root = replicas[0].root_cert_path.read_text()
    expected = _namespaces(control_plane) - SKIPPED_NAMESPACES
    wait_for(
        lambda: all(_published(control_plane, ns, root) for ns in expected),
        15,
        "the root ConfigMap in every namespace",
    )
    for namespace in SKIPPED_NAMESPACES:
        assert not _published(control_plane, namespace, root)

    # Deleted: re-created.
    control_plane.core.delete_namespaced_config_map(CONFIGMAP_NAME, shop)
    wait_for(lambda: _published(control_plane, shop, root), 5, "deleted copy restored")
    # A new namespace gets one.
    team = unique("team")
    control_plane.create_namespace(team)
    wait_for(lambda: _published(control_plane, team, root), 5, "new namespace")
    # Edited: restored, a key someone added kept.
    edited = control_plane.core.read_namespaced_config_map(CONFIGMAP_NAME, "default")
    edited.data = {"root-cert.pem": "not a root", "extra": "kept"}
    edited.metadata.labels = {}
    control_plane.core.replace_namespaced_config_map(CONFIGMAP_NAME, "default", edited)
    wait_for(lambda: _published(control_plane, "default", root), 5, "edited copy restored")
    restored = control_plane.core.read_namespaced_config_map(CONFIGMAP_NAME, "default")
    assert restored.data["extra"] == "kept"

    leader = _leader(replicas)
    lease_api: Any = kubernetes.client.CoordinationV1Api(control_plane.admin())
    (lease,) = lease_api.list_namespaced_lease(ca_account.namespace).items
    assert lease.spec.holder_identity == leader.data_dir.name
    writers = _writers(control_plane, ca_account)
    assert set(writers) == {f"meshca-ca/{leader.data_dir.name}"}, writers

    # The leader stops (releasing the Lease): the other replica takes over the writing.
    follower = next(ca for ca in replicas if ca is not leader)
    leader.stop()
    assert _leader([follower]) is follower
    control_plane.core.delete_namespaced_config_map(CONFIGMAP_NAME, shop)
    wait_for(lambda: _published(control_plane, shop, root), 10, "restored by the new leader")
    assert _writers(control_plane, ca_account)[f"meshca-ca/{follower.data_dir.name}"] >= 1
    lease = lease_api.read_namespaced_lease(lease.metadata.name, ca_account.namespace)
    assert lease.spec.holder_identity == follower.data_dir.name
