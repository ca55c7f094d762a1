"""`deploy/`'s RBAC, applied to a real API server for one test's copy of a component's account.

Each test gets its own namespace and ServiceAccount (RBAC objects are cluster-wide, and a test
that removes a rule must not take it from the next test), so the Roles, ClusterRoles and
bindings that `deploy/` grants `istio-system/meshca` (or `meshca-node-agent`) are applied
renamed for that account: same rules, read from the YAML. `drop` takes out one flat rule
(`tests.support.deploy_rbac.Rule`), the least-privilege tests' "all but this one".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from tests.support.deploy_manifests import Manifest, manifests
from tests.support.deploy_rbac import RBAC_API_VERSION, Rule, Scope
from tests.support.processes import wait_for

from .control_plane import RealControlPlane

DEPLOY_NAMESPACE = "istio-system"


def _bound_to(binding: Manifest, namespace: str, account: str) -> bool:
    return any(
        s.get("kind") == "ServiceAccount"
        and s.get("name") == account
        and s.get("namespace", binding.namespace) == namespace
        for s in binding.doc.get("subjects") or []
    )


def _flat_rules(rules: list[dict[str, Any]], scope: Scope, drop: Rule) -> list[dict[str, Any]]:
    """`rules` one (group, resource, verb, name) per entry, without `drop` (when it has
    `scope`)."""
    flat: list[dict[str, Any]] = []
    for rule in rules:
        for url in rule.get("nonResourceURLs") or []:
            for verb in rule.get("verbs") or []:
                if Rule("", url, verb, scope) != drop:
                    flat.append({"nonResourceURLs": [url], "verbs": [verb]})
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                for verb in rule.get("verbs") or []:
                    for name in rule.get("resourceNames") or [""]:
                        if Rule(group, resource, verb, scope, name) == drop:
                            continue
                        entry = {"apiGroups": [group], "resources": [resource], "verbs": [verb]}
                        flat.append({**entry, "resourceNames": [name]} if name else entry)
    return flat


@dataclass
class AppliedRbac:
    """The objects created, to delete after the test."""

    objects: list[tuple[str, str | None, str]]  # (kind, namespace, name)

    def delete(self, plane: RealControlPlane) -> None:
        api: Any = kubernetes.client.RbacAuthorizationV1Api(plane.admin())
        for kind, namespace, name in self.objects:
            try:
                if kind == "ClusterRole":
                    api.delete_cluster_role(name)
                elif kind == "ClusterRoleBinding":
                    api.delete_cluster_role_binding(name)
                elif kind == "Role":
                    api.delete_namespaced_role(name, namespace)
                else:
                    api.delete_namespaced_role_binding(name, namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise


def deploy_rbac_objects(account: str) -> tuple[list[Manifest], list[Manifest]]:
    """(roles, bindings) in deploy/ that grant `istio-system/<account>`."""
    objects = [m for m in manifests() if m.doc.get("apiVersion") == RBAC_API_VERSION]
    bindings = [
        m
        for m in objects
        if m.kind in ("RoleBinding", "ClusterRoleBinding")
        and _bound_to(m, DEPLOY_NAMESPACE, account)
    ]
    wanted = {(b.doc["roleRef"]["kind"], b.doc["roleRef"]["name"]) for b in bindings}
    roles = [m for m in objects if (m.kind, m.name) in wanted]
    return roles, bindings


def apply_deploy_rbac(
    plane: RealControlPlane,
    namespace: str,
    service_account: str,
    *,
    deploy_account: str = "meshca",
    drop: Rule | None = None,
) -> AppliedRbac:
    """Grants `namespace/service_account` what deploy/ grants `istio-system/<deploy_account>`
    (minus `drop`); returns once the authorizer allows the grant."""
    api: Any = kubernetes.client.RbacAuthorizationV1Api(plane.admin())
    roles, bindings = deploy_rbac_objects(deploy_account)
    suffix = f"{namespace}-{service_account}"
    applied = AppliedRbac([])
    granted: list[list[dict[str, Any]]] = []  # each role's rules, as created
    for role in roles:
        body = copy.deepcopy(role.doc)
        body["metadata"] = {"name": f"{role.name}-{suffix}"}
        scope: Scope = "cluster" if role.kind == "ClusterRole" else "namespace"
        if drop is not None:
            body["rules"] = _flat_rules(body.get("rules") or [], scope, drop)
        granted.append(body.get("rules") or [])
        if role.kind == "ClusterRole":
            api.create_cluster_role(body)
            applied.objects.append(("ClusterRole", None, body["metadata"]["name"]))
        else:
            body["metadata"]["namespace"] = namespace
            api.create_namespaced_role(namespace, body)
            applied.objects.append(("Role", namespace, body["metadata"]["name"]))
    for binding in bindings:
        body = copy.deepcopy(binding.doc)
        body["metadata"] = {"name": f"{binding.name}-{suffix}"}
        body["roleRef"] = {**body["roleRef"], "name": f"{body['roleRef']['name']}-{suffix}"}
        body["subjects"] = [
            {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
        ]
        if binding.kind == "ClusterRoleBinding":
            api.create_cluster_role_binding(body)
            applied.objects.append(("ClusterRoleBinding", None, body["metadata"]["name"]))
        else:
            body["metadata"]["namespace"] = namespace
            api.create_namespaced_role_binding(namespace, body)
            applied.objects.append(("RoleBinding", namespace, body["metadata"]["name"]))
    _wait_effective(plane, namespace, service_account, granted)
    return applied


def _wait_effective(
    plane: RealControlPlane,
    namespace: str,
    service_account: str,
    granted: list[list[dict[str, Any]]],
) -> None:
    """The authorizer reads RBAC from informers, one per kind (Role, RoleBinding, ClusterRole,
    ClusterRoleBinding), each with its own lag: wait until it allows one rule of every role
    created, so each role and its binding have reached it, not just the first."""
    api: Any = kubernetes.client.AuthorizationV1Api(plane.admin())
    user = f"system:serviceaccount:{namespace}:{service_account}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"]
    for rules in granted:
        sample = next((rule for rule in rules if rule.get("resources")), None)
        if sample is None:
            continue
        names = sample.get("resourceNames") or [None]
        review = kubernetes.client.V1SubjectAccessReview(
            spec=kubernetes.client.V1SubjectAccessReviewSpec(
                user=user,
                groups=groups,
                resource_attributes=kubernetes.client.V1ResourceAttributes(
                    group=sample["apiGroups"][0],
                    resource=sample["resources"][0],
                    verb=sample["verbs"][0],
                    namespace=namespace,
                    name=names[0],
                ),
            )
        )

        def allowed(review: Any = review) -> bool:
            return bool(api.create_subject_access_review(review).status.allowed)

        wait_for(
            allowed,
            10,
            f"RBAC for {namespace}/{service_account} to take effect ({sample})",
            interval=0.1,
        )
