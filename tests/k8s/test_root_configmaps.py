"""Done means 3: ConfigMap `istio-ca-root-cert` in every namespace, kept in sync by watches —
restored when deleted or edited, created for new namespaces, within 2 s — and written only by
the replica holding the Lease; the other takes over when the leader stops."""

from __future__ import annotations

from collections import Counter

from ca_server.kube.root_publisher import CONFIGMAP_NAME
from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory
from tests.support.metrics import sample_value
from tests.support.processes import wait_for

SYNC_DEADLINE = 2.0


def _published(kube_api: KubeApiServer, namespace: str, root: str) -> bool:
    cm = kube_api.get("configmaps", CONFIGMAP_NAME, namespace=namespace, missing_ok=True)
    return (
        cm is not None
        and cm.get("data", {}).get("root-cert.pem") == root
        and cm["metadata"].get("labels", {}).get("istio.io/config") == "true"
    )


def _writers(kube_api: KubeApiServer) -> Counter[str | None]:
    return Counter(
        r.user_agent
        for r in kube_api.requests()
        if r.resource == "configmaps" and r.verb in ("create", "update", "patch", "delete")
    )


def _leader(replicas: list[CaProcess]) -> CaProcess:
    def leaders() -> list[CaProcess]:
        return [
            ca for ca in replicas
            if sample_value(ca.metrics(), "meshca_ca_root_publisher_leader") == 1
        ]  # fmt: skip

    wait_for(lambda: len(leaders()) == 1, 10, "exactly one leader")
    return leaders()[0]


def test_root_configmaps_follow_the_cluster(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    replicas = [kube_ca(f"ca-{i}", start=False) for i in range(2)]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()
    root = replicas[0].root_cert_path.read_text()
    expected = ["default", CA_NAMESPACE, "kube-system", "shop"]
    wait_for(lambda: all(_published(kube_api, ns, root) for ns in expected), 5, "ConfigMaps")
    assert {cm["metadata"]["namespace"] for cm in kube_api.list("configmaps")} == set(expected)

    kube_api.delete("configmaps", CONFIGMAP_NAME, namespace="shop")
    wait_for(lambda: _published(kube_api, "shop", root), SYNC_DEADLINE, "deleted copy restored")

    kube_api.create_namespace("new-team")
    wait_for(lambda: _published(kube_api, "new-team", root), SYNC_DEADLINE, "new namespace")

    edited = kube_api.get("configmaps", CONFIGMAP_NAME, namespace="default")
    edited["data"] = {"root-cert.pem": "not a root", "extra": "kept"}
    edited["metadata"]["labels"] = {}
    kube_api.update("configmaps", edited)
    wait_for(lambda: _published(kube_api, "default", root), SYNC_DEADLINE, "edited copy restored")
    restored = kube_api.get("configmaps", CONFIGMAP_NAME, namespace="default")
    assert restored["data"]["extra"] == "kept"

    leader = _leader(replicas)
    writers = _writers(kube_api)
    assert set(writers) == {f"meshca-ca/{leader.data_dir.name}"}, writers

    # The leader stops (releasing the Lease): the other replica takes over the writing.
    follower = next(ca for ca in replicas if ca is not leader)
    leader.stop()
    assert _leader([follower]) is follower
    kube_api.delete("configmaps", CONFIGMAP_NAME, namespace="shop")
    wait_for(lambda: _published(kube_api, "shop", root), 5, "restored by the new leader")
    assert _writers(kube_api)[f"meshca-ca/{follower.data_dir.name}"] >= 1
    for namespace in ("kube-public", "kube-node-lease"):
        assert (
            kube_api.get("configmaps", CONFIGMAP_NAME, namespace=namespace, missing_ok=True) is None
        )
