"""The chart installed with the real `helm` into the real API server (issue 33, Done means 2):
the CA, authenticated as the chart's own ServiceAccount, does its whole job — the root Secret,
the root ConfigMaps under the Lease, its replica report, Secret istiod-tls, a workload
certificate through TokenReview — with not one request refused in the API server's audit log;
`helm upgrade` changes the replicas; `helm uninstall` removes every object of the chart and
leaves exactly what docs/istio-migration.md says is kept."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from ca_server.jwt_svid.kube_store import JWT_SECRET_NAME
from ca_server.kube.istiod_tls import SECRET_NAME as ISTIOD_TLS_SECRET
from ca_server.kube.leader import DEFAULT_LEASE_NAME
from ca_server.kube.replica_reports import report_name
from ca_server.kube.root_publisher import CONFIGMAP_NAME
from ca_server.kube.secret_root import SECRET_NAME
from tests.k8s_real.conftest import unique
from tests.support.ca_process import CaProcess
from tests.support.helm import CHART_DIR, Helm, chart_objects
from tests.support.kube_mode import issue, spiffe
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane

# What `helm uninstall` leaves (docs/istio-migration.md, "Uninstall"): objects the CA wrote,
# not the chart — kind, name (in the CA's namespace unless said).
KEPT_AFTER_UNINSTALL = {
    ("Secret", SECRET_NAME),
    ("Secret", ISTIOD_TLS_SECRET),
    ("Secret", JWT_SECRET_NAME),
    ("ConfigMap", CONFIGMAP_NAME),
    ("ConfigMap", report_name("ca-0")),
    ("Lease", DEFAULT_LEASE_NAME),
}


def _meshca_written(plane: RealControlPlane, namespace: str) -> set[tuple[str, str]]:
    """What remains in the namespace of what the CA wrote (not the chart)."""
    core: Any = plane.core
    leases: Any = kubernetes.client.CoordinationV1Api(plane.admin())
    found = {("Secret", s.metadata.name) for s in core.list_namespaced_secret(namespace).items}
    found |= {
        ("ConfigMap", c.metadata.name)
        for c in core.list_namespaced_config_map(namespace).items
        if c.metadata.name != "kube-root-ca.crt"
    }
    found |= {("Lease", x.metadata.name) for x in leases.list_namespaced_lease(namespace).items}
    return found


def _wait_rbac(plane: RealControlPlane, namespace: str) -> None:
    """Until the authorizer applies the chart's RBAC (its informers lag a create)."""
    authorization: Any = kubernetes.client.AuthorizationV1Api(plane.admin())

    def allowed(verb: str, resource: str, group: str = "", name: str | None = None) -> bool:
        review = kubernetes.client.V1SubjectAccessReview(
            spec=kubernetes.client.V1SubjectAccessReviewSpec(
                user=f"system:serviceaccount:{namespace}:meshca",
                groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                resource_attributes=kubernetes.client.V1ResourceAttributes(
                    group=group, resource=resource, verb=verb, namespace=namespace, name=name
                ),
            )
        )
        return bool(authorization.create_subject_access_review(review).status.allowed)

    wait_for(
        lambda: (
            allowed("create", "tokenreviews", "authentication.k8s.io")
            and allowed("get", "secrets", name=ISTIOD_TLS_SECRET)
            and allowed("get", "leases", "coordination.k8s.io")
        ),
        10,
        "the chart's RBAC to take effect",
    )


def test_helm_install_then_the_ca_as_its_account_does_its_job_unrefused(
    tmp_path: Path, control_plane: RealControlPlane
):
    namespace = unique("helm")
    helm = Helm(tmp_path / "helm", control_plane.admin_kubeconfig(tmp_path / "admin.kubeconfig"))
    helm.run("install", "meshca", str(CHART_DIR), "--namespace", namespace, "--create-namespace")
    apps: Any = kubernetes.client.AppsV1Api(control_plane.admin())
    assert apps.read_namespaced_deployment("meshca", namespace).spec.replicas == 2
    installed = chart_objects(control_plane, namespace)
    assert ("ServiceAccount", "meshca") in installed and ("ClusterRole", "meshca") in installed

    _wait_rbac(control_plane, namespace)
    kubeconfig = control_plane.account_kubeconfig(tmp_path / "ca.kubeconfig", namespace, "meshca")
    ca = CaProcess(
        tmp_path / "ca",
        *("--kubeconfig", str(kubeconfig), "--namespace", namespace, "--instance-id", "ca-0"),
    )
    core: Any = control_plane.core
    try:
        ca.start()
        apps_ns = unique("app")
        control_plane.create_namespace(apps_ns)
        control_plane.create_service_account(apps_ns, "cart")
        pod = control_plane.create_pod(apps_ns, "cart-1", "cart")
        token = control_plane.request_token(apps_ns, "cart", audiences=("istio-ca",), pod=pod)
        assert len(issue(ca, token, spiffe(apps_ns, "cart"))) == 2

        def published(ns: str) -> bool:
            try:
                cm = core.read_namespaced_config_map(CONFIGMAP_NAME, ns)
            except ApiException:
                return False
            return (cm.data or {}).get("root-cert.pem") == ca.root_cert_path.read_text()

        def done() -> bool:
            try:
                core.read_namespaced_secret(SECRET_NAME, namespace)
                tls = core.read_namespaced_secret(ISTIOD_TLS_SECRET, namespace)
            except ApiException:
                return False
            bundle = base64.b64decode(tls.data["ca.crt"]).decode()
            return (
                bundle == ca.root_cert_path.read_text()
                and published(namespace)
                and published(apps_ns)
                and (namespace, report_name("ca-0")) in _reports(core, namespace)
            )

        wait_for(done, 30, "the CA's whole job", 0.2)
    finally:
        ca.stop()
    username = f"system:serviceaccount:{namespace}:meshca"
    events = control_plane.audit_events(username)
    assert {e["verb"] for e in events} >= {"create", "get", "update", "list", "watch"}
    refused = [
        (e["verb"], e.get("objectRef"), e["requestURI"])
        for e in events
        if int(e.get("responseStatus", {}).get("code", 0)) == 403
    ]
    assert refused == [], f"requests the chart's RBAC refused: {refused}\n{ca.log()[-2000:]}"

    helm.run("upgrade", "meshca", str(CHART_DIR), "--namespace", namespace,
             "--set", "replicaCount=3")  # fmt: skip
    assert apps.read_namespaced_deployment("meshca", namespace).spec.replicas == 3
    assert helm.run("history", "meshca", "--namespace", namespace).stdout.count("\n") == 3

    helm.run("uninstall", "meshca", "--namespace", namespace)
    assert chart_objects(control_plane, namespace) == set()
    assert _meshca_written(control_plane, namespace) == KEPT_AFTER_UNINSTALL


def _reports(core: Any, namespace: str) -> set[tuple[str, str]]:
    return {(namespace, c.metadata.name) for c in core.list_namespaced_config_map(namespace).items}
