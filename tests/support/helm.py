"""Running the real `helm` (built from helm.sh/helm/v4, tests/realbin/helm) on meshca's chart.

Each call gets its own HELM_* homes under a test's directory, so no repository list, cache or
plugin of the machine's user leaks in, and `--kubeconfig` points it at a test's API server.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml

from tests.support.deploy_manifests import DEPLOY_DIR
from tests.support.real_binaries import binary
from tests.support.real_kube import RealControlPlane

CHART_DIR = DEPLOY_DIR / "helm" / "meshca"


class Helm:
    def __init__(self, home: Path, kubeconfig: Path | None = None) -> None:
        self.home = home
        self.kubeconfig = kubeconfig
        self.binary = binary("helm")

    def env(self) -> dict[str, str]:
        homes = {
            name: str(self.home / name.lower())
            for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")
        }
        base = {"PATH": "/usr/bin:/bin", "HOME": str(self.home)}
        if self.kubeconfig is not None:
            base["KUBECONFIG"] = str(self.kubeconfig)
        return {**base, **homes}

    def run(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}{result.stdout}")
        return result

    def template(self, *args: str, namespace: str = "istio-system") -> list[dict[str, Any]]:
        """The objects `helm template` renders for the chart with `args` (e.g. --set ...)."""
        out = self.run("template", "meshca", str(CHART_DIR), "--namespace", namespace, *args)
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def chart_objects(plane: RealControlPlane, namespace: str) -> set[tuple[str, str]]:
    """The chart's objects that exist: everything labelled part-of=meshca in the namespace
    and the cluster-scoped RBAC named meshca."""
    selector = "app.kubernetes.io/part-of=meshca"
    admin = plane.admin()
    core: Any = kubernetes.client.CoreV1Api(admin)
    apps: Any = kubernetes.client.AppsV1Api(admin)
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(admin)
    policy: Any = kubernetes.client.PolicyV1Api(admin)
    networking: Any = kubernetes.client.NetworkingV1Api(admin)
    listed = {
        "ServiceAccount": core.list_namespaced_service_account,
        "Service": core.list_namespaced_service,
        "Deployment": apps.list_namespaced_deployment,
        "Role": rbac.list_namespaced_role,
        "RoleBinding": rbac.list_namespaced_role_binding,
        "PodDisruptionBudget": policy.list_namespaced_pod_disruption_budget,
        "NetworkPolicy": networking.list_namespaced_network_policy,
    }
    found = {
        (kind, item.metadata.name)
        for kind, lister in listed.items()
        for item in lister(namespace, label_selector=selector).items
    }
    for kind, lister in (
        ("ClusterRole", rbac.list_cluster_role),
        ("ClusterRoleBinding", rbac.list_cluster_role_binding),
    ):
        found |= {(kind, i.metadata.name) for i in lister(label_selector=selector).items}
    return found
