"""Loading the plain-YAML manifests under ``deploy/`` (no kustomize binary needed)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
KUSTOMIZATION = "kustomization.yaml"


@dataclass(frozen=True)
class Manifest:
    """One YAML document: the file it came from and its index there (for error messages)."""

    path: Path
    index: int
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc.get("kind", ""))

    @property
    def name(self) -> str:
        return str(self.doc.get("metadata", {}).get("name", ""))

    @property
    def namespace(self) -> str | None:
        namespace = self.doc.get("metadata", {}).get("namespace")
        return None if namespace is None else str(namespace)

    def __str__(self) -> str:
        return f"{self.path.relative_to(DEPLOY_DIR.parent)}[{self.index}] {self.kind}/{self.name}"


# Prometheus's own files (a rule file and promtool unit tests), not Kubernetes objects.
PROMETHEUS_FILE_DIRS = (DEPLOY_DIR / "monitoring" / "rules", DEPLOY_DIR / "monitoring" / "tests")
# The Helm chart: templates, not objects (tests/deploy/test_helm_chart.py renders them).
HELM_DIR = DEPLOY_DIR / "helm"


def yaml_files(root: Path = DEPLOY_DIR) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*")
        if p.suffix in (".yaml", ".yml")
        and p.is_file()
        and not any(p.is_relative_to(d) for d in (*PROMETHEUS_FILE_DIRS, HELM_DIR))
    )


def kustomization_files(root: Path = DEPLOY_DIR) -> list[Path]:
    return [p for p in yaml_files(root) if p.name == KUSTOMIZATION]


def load_file(path: Path) -> list[Manifest]:
    with path.open(encoding="utf-8") as stream:
        docs = [d for d in yaml.safe_load_all(stream) if d is not None]
    for index, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ValueError(f"{path}[{index}]: a manifest must be a mapping, got {type(doc)}")
    return [Manifest(path, i, d) for i, d in enumerate(docs)]


def manifests(root: Path = DEPLOY_DIR) -> Iterator[Manifest]:
    """Every Kubernetes object under ``root``: all YAML documents except kustomization files."""
    for path in yaml_files(root):
        if path.name != KUSTOMIZATION:
            yield from load_file(path)


def patch_files(root: Path = DEPLOY_DIR) -> set[Path]:
    """The files kustomizations apply as patches: partial objects, not whole ones."""
    found = set()
    for path in yaml_files(root):
        if path.name == KUSTOMIZATION:
            kustomization = load_kustomization(path.parent)
            found |= {
                (path.parent / p["path"]).resolve() for p in kustomization.get("patches") or []
            }
    return found


def find(kind: str, name: str, under: str = "base") -> Manifest:
    """The one object of ``kind``/``name`` in ``deploy/<under>``."""
    found = [m for m in manifests(DEPLOY_DIR / under) if m.kind == kind and m.name == name]
    if len(found) != 1:
        raise LookupError(f"expected one {kind}/{name} under deploy/{under}, found {len(found)}")
    return found[0]


# -- a small kustomize, enough for deploy/ -------------------------------------------------------
#
# Supports what deploy/ uses and fails loudly on anything else: `resources` (files and
# directories), `patches` with `path` (strategic merge, targeted by the patch's own kind and
# name), and `namespace`. Merging follows the strategic-merge rules for the fields deploy/ patches:
# maps merge, null deletes, lists of objects with a `name` (containers, volumes, env, ports)
# merge by name, every other list is replaced.

SUPPORTED_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "patches"}
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def load_kustomization(directory: Path) -> dict[str, Any]:
    with (directory / KUSTOMIZATION).open(encoding="utf-8") as stream:
        kustomization = yaml.safe_load(stream)
    if not isinstance(kustomization, dict):
        raise ValueError(f"{directory / KUSTOMIZATION}: not a mapping")
    return kustomization


def strategic_merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value)
            else:
                merged[key] = value
        return merged
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(item, dict) and "name" in item for item in base + patch)
    ):
        merged_list = list(base)
        for item in patch:
            names = [existing["name"] for existing in merged_list]
            if item["name"] in names:
                index = names.index(item["name"])
                merged_list[index] = strategic_merge(merged_list[index], item)
            else:
                merged_list.append(item)
        return merged_list
    return patch


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k directory`` would send (labels transformer left out)."""
    kustomization = load_kustomization(directory)
    unsupported = set(kustomization) - SUPPORTED_KUSTOMIZATION_KEYS
    if unsupported:
        raise ValueError(f"{directory}: kustomization keys not modelled: {sorted(unsupported)}")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources") or []:
        target = directory / entry
        if target.is_dir():
            objects.extend(render(target))
        else:
            objects.extend(m.doc for m in load_file(target))
    for patch_entry in kustomization.get("patches") or []:
        if set(patch_entry) != {"path"}:
            raise ValueError(f"{directory}: only `patches: - path:` is modelled, got {patch_entry}")
        for patch in load_file(directory / patch_entry["path"]):
            matches = [
                i
                for i, obj in enumerate(objects)
                if obj["kind"] == patch.kind and obj["metadata"]["name"] == patch.name
            ]
            if len(matches) != 1:
                raise LookupError(f"{patch}: matches {len(matches)} objects in {directory}")
            objects[matches[0]] = strategic_merge(objects[matches[0]], patch.doc)
    namespace = kustomization.get("namespace")
    if namespace is not None:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED_KINDS:
                obj["metadata"] = {**obj["metadata"], "namespace": namespace}
    return objects
