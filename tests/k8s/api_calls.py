"""Which Kubernetes API calls the CA makes — the contract the deploy RBAC must grant exactly.

`ALLOWED_API_CALLS` is the declared set. Every test in `tests/k8s` checks, from the fake API
server's request log, that the CA made no call outside it (`tests/k8s/conftest.py`), and adds
what it saw to the session's observed set, which is stored in pytest's cache under
`meshca/k8s-api-calls` (`pytest --cache-show 'meshca/*'` prints it after a run).

`namespaced=False` means a cluster-wide call (all namespaces, or a cluster-scoped resource):
those need a ClusterRole; namespaced calls on Secrets and Leases happen only in the CA's own
namespace (a Role there), while ConfigMap writes happen in every namespace (a ClusterRole).

    python -m tests.k8s.api_calls   # prints the calls as RBAC-style rules
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from tests.support.kube_api import RequestRecord


class ApiCall(NamedTuple):
    api_group: str  # "" for the core group
    resource: str
    verb: str
    namespaced: bool


ALLOWED_API_CALLS: frozenset[ApiCall] = frozenset(
    [
        # TokenReview authenticator.
        ApiCall("authentication.k8s.io", "tokenreviews", "create", False),
        # Shared root (Secret istio-ca-secret, CA namespace): read, create once, watch.
        ApiCall("", "secrets", "get", True),
        ApiCall("", "secrets", "create", True),
        ApiCall("", "secrets", "list", True),
        ApiCall("", "secrets", "watch", True),
        # Root-publisher Lease (CA namespace).
        ApiCall("coordination.k8s.io", "leases", "get", True),
        ApiCall("coordination.k8s.io", "leases", "create", True),
        ApiCall("coordination.k8s.io", "leases", "update", True),
        # Root ConfigMaps: watched cluster-wide, written in each namespace.
        ApiCall("", "configmaps", "list", False),
        ApiCall("", "configmaps", "watch", False),
        ApiCall("", "configmaps", "create", True),
        ApiCall("", "configmaps", "update", True),
        # Namespaces (for ConfigMaps) and pods (node authorizer), cluster-wide.
        ApiCall("", "namespaces", "list", False),
        ApiCall("", "namespaces", "watch", False),
        ApiCall("", "pods", "list", False),
        ApiCall("", "pods", "watch", False),
    ]
)


def api_group_of(path: str) -> str:
    """`/apis/<group>/<version>/...` → group; `/api/v1/...` → "" (core)."""
    segments = [s for s in path.split("?")[0].split("/") if s]
    return segments[1] if segments and segments[0] == "apis" else ""


def observed_api_calls(records: Iterable[RequestRecord]) -> set[ApiCall]:
    return {
        ApiCall(api_group_of(r.path), r.resource, r.verb, r.namespace is not None) for r in records
    }


def rbac_rules(calls: Iterable[ApiCall]) -> list[str]:
    """Calls grouped as `(cluster|namespace) group/resource: verbs`, one line per rule."""
    rules: dict[tuple[bool, str, str], set[str]] = {}
    for call in calls:
        rules.setdefault((call.namespaced, call.api_group, call.resource), set()).add(call.verb)
    return [
        f"{'namespace' if namespaced else 'cluster'} {group or 'core'}/{resource}: "
        f"{', '.join(sorted(verbs))}"
        for (namespaced, group, resource), verbs in sorted(rules.items())
    ]


if __name__ == "__main__":
    print("\n".join(rbac_rules(ALLOWED_API_CALLS)))
