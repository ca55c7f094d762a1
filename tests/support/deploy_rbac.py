"""The RBAC that ``deploy/`` grants, as a flat set of rules to compare with real API traffic.

A rule is ``(api_group, resource, verb, scope, name)``; ``scope`` is ``"cluster"`` for a
ClusterRole bound by a ClusterRoleBinding, and ``"namespace"`` for anything bound by a
RoleBinding (in the binding's namespace, which is the service account's own in deploy/);
``name`` is one object the rule is limited to (RBAC's ``resourceNames``), ``""`` any. Example,
comparing with the requests the fake API server recorded::

    granted = granted_rules("istio-system", "meshca")
    for record in server.recorder.records():
        needed = required_rule(group_of(record.resource), record.resource, record.verb,
                               record.namespace, home_namespace="istio-system",
                               name=authorized_name(record.verb, record.name, selector))
        assert is_allowed(granted, needed), needed

A request's name is the one the API server's authorizer sees (apiserver's ``RequestInfo``): the
object's, in its path; for a list or watch, the name a ``metadata.name=`` field selector pins
(so a rule limited to one object allows watching just that object); none for a create (the
name is in the body, which the authorizer never reads: RBAC cannot limit a create to a name).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

from tests.support.deploy_manifests import DEPLOY_DIR, Manifest, manifests

Scope = Literal["namespace", "cluster"]
RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"


class Rule(NamedTuple):
    api_group: str
    resource: str
    verb: str
    scope: Scope
    name: str = ""  # the one object the rule allows (resourceNames); "" any


class UnsupportedRbac(ValueError):
    """A rule this flat model cannot represent (aggregation, resourceNames on a URL)."""


def _expand(rules: Iterable[dict[str, Any]], scope: Scope, where: str) -> set[Rule]:
    """Flat rules; a non-resource URL (e.g. ``/openid/v1/jwks``) becomes
    ``Rule("", url, verb, "cluster")`` — its leading ``/`` keeps it apart from resource names,
    and the recorded request of such a URL uses the path as its resource."""
    expanded: set[Rule] = set()
    for rule in rules:
        names = rule.get("resourceNames") or [""]
        for url in rule.get("nonResourceURLs") or []:
            if scope != "cluster":
                raise UnsupportedRbac(f"{where}: nonResourceURLs only work in a ClusterRole")
            if names != [""]:
                raise UnsupportedRbac(f"{where}: resourceNames on a non-resource URL")
            expanded.update(Rule("", url, verb, scope) for verb in rule.get("verbs") or [])
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                for verb in rule.get("verbs") or []:
                    expanded.update(Rule(group, resource, verb, scope, name) for name in names)
    return expanded


def _rbac_objects(root: Path) -> list[Manifest]:
    return [m for m in manifests(root) if m.doc.get("apiVersion") == RBAC_API_VERSION]


def granted_rules(namespace: str, service_account: str, root: Path = DEPLOY_DIR) -> set[Rule]:
    """Every ``Rule`` bound to the ServiceAccount ``namespace/service_account`` under ``root``."""
    objects = _rbac_objects(root)
    roles = {(m.kind, m.namespace, m.name): m for m in objects if m.kind in ("Role", "ClusterRole")}
    granted: set[Rule] = set()
    for binding in objects:
        if binding.kind not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = binding.doc.get("subjects") or []
        if not any(
            s.get("kind") == "ServiceAccount"
            and s.get("name") == service_account
            and s.get("namespace", binding.namespace) == namespace
            for s in subjects
        ):
            continue
        ref = binding.doc["roleRef"]
        role_namespace = binding.namespace if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], role_namespace, ref["name"]))
        if role is None:
            raise LookupError(f"{binding}: roleRef {ref['kind']}/{ref['name']} is not in deploy/")
        if role.doc.get("aggregationRule"):
            raise UnsupportedRbac(
                f"{role}: aggregated roles are not modelled by tests/support/deploy_rbac.py"
            )
        scope: Scope = "cluster" if binding.kind == "ClusterRoleBinding" else "namespace"
        granted |= _expand(role.doc.get("rules") or [], scope, str(role))
    return granted


def authorized_name(verb: str, name: str | None, field_selector: str | None) -> str:
    """The object name the API server's authorizer sees for a request (see the module
    docstring): `name` from the path, or for a list or watch the one an exact
    `metadata.name=<name>` field selector pins; "" when none."""
    if verb in ("list", "watch") and not name and field_selector:
        for term in field_selector.split(","):
            field, _, value = term.partition("=")  # `f=v`, `f==v`; `f!=v` leaves `f!`
            if field.strip() == "metadata.name":
                return value.removeprefix("=").strip()
    return name or ""


def required_rule(
    api_group: str,
    resource: str,
    verb: str,
    namespace: str | None,
    home_namespace: str,
    name: str | None = None,
) -> Rule:
    """The narrowest rule that allows one request made by an account living in
    ``home_namespace``. ``namespace`` None is a cluster-wide call (a cluster-scoped resource such
    as tokenreviews, or list/watch across all namespaces); a call into another namespace than the
    account's own needs a cluster grant too, since deploy/ binds Roles only in the home namespace.
    ``name`` is the object the authorizer sees (`authorized_name`); a create has none.
    """
    scope: Scope = "namespace" if namespace == home_namespace else "cluster"
    return Rule(api_group, resource, verb, scope, "" if verb == "create" else name or "")


def granting_rule(granted: Iterable[Rule], needed: Rule) -> Rule | None:
    """The rule in ``granted`` that allows ``needed``: the same rule, or one for any name, or
    either granted cluster-wide (which also allows a namespaced call); None if none does."""
    rules = set(granted)
    candidates = [needed, needed._replace(name="")]
    if needed.scope == "namespace":
        candidates += [c._replace(scope="cluster") for c in candidates]
    return next((c for c in candidates if c in rules), None)


def is_allowed(granted: set[Rule], needed: Rule) -> bool:
    """Whether ``granted`` allows ``needed``."""
    return granting_rule(granted, needed) is not None
