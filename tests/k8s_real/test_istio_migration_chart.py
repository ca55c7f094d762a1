"""docs/istio-migration.md's cluster commands (its ```bash blocks), exactly as written, with the
real `helm` against the real API server: install into istio-system, read the notes, upgrade,
uninstall. (Its ```sh blocks, the agent walk-through on a local CA, run in
tests/e2e/test_istio_migration_doc.py.) Between blocks the test checks what each did, and that
the notes give Istio's charts the values the page gives."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml

from tests.support.helm import Helm, chart_objects
from tests.support.processes import REPO_ROOT
from tests.support.real_kube import RealControlPlane

PAGE = REPO_ROOT / "docs" / "istio-migration.md"
NAMESPACE = "istio-system"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.S)


def test_the_pages_helm_commands_run_as_written(tmp_path: Path, control_plane: RealControlPlane):
    helm = Helm(tmp_path / "helm", control_plane.admin_kubeconfig(tmp_path / "admin.kubeconfig"))
    env = {**helm.env(), "PATH": f"{helm.binary.parent}:/usr/bin:/bin"}
    install, upgrade, uninstall = _blocks("bash")
    apps: Any = kubernetes.client.AppsV1Api(control_plane.admin())

    def run(block: str) -> str:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{block}\n{result.stderr}{result.stdout}"
        return result.stdout

    try:
        notes = run(install)
        assert apps.read_namespaced_deployment("meshca", NAMESPACE).spec.replicas == 2
        # The notes give Istio's istiod chart what the page's values file gives it.
        (istiod_values,) = (yaml.safe_load(b) for b in _blocks("yaml"))
        assert f"caAddress: {istiod_values['global']['caAddress']}" in notes
        assert 'ENABLE_CA_SERVER: "false"' in notes
        assert f"trustDomain: {istiod_values['meshConfig']['trustDomain']}" in notes

        run(upgrade)
        assert apps.read_namespaced_deployment("meshca", NAMESPACE).spec.replicas == 3

        run(uninstall)
        assert chart_objects(control_plane, NAMESPACE) == set()
    finally:
        helm.run("uninstall", "meshca", "--namespace", NAMESPACE, "--ignore-not-found", check=False)
