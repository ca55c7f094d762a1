"""The Kubernetes permissions meshca's code needs — one contract for tests and `deploy/` RBAC.

`CA_RBAC` and `NODE_AGENT_RBAC` are the rules (in `tests.support.deploy_rbac.Rule` form) that
the CA and the node agent need for the API calls they make. Three checks keep code and manifests
equal:

- every Kubernetes-mode test fails if the process under test made a call these rules do not
  allow (`tests/support/kube_mode.py`, `tests/agent/test_node_identities.py`);
- a full run of `tests/k8s` fails if some rule in `CA_RBAC` was never needed (granted but
  unused);
- `tests/deploy/test_manifests.py` asserts `deploy/` grants exactly these rules.

A rule's scope is `namespace` when the calls happen only in the account's own namespace (a Role
there), `cluster` for cluster-wide list/watch, cluster-scoped resources, or writes into any
namespace (a ClusterRole). A rule with a `name` allows that one object only (RBAC's
`resourceNames`): the code touches the authority Secret by name alone, and lists and watches it
with a `metadata.name` field selector, which the API server authorizes as that name.

    python -m tests.support.kube_api_calls   # prints the rules
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable

from ca_server.jwt_svid.kube_store import JWT_SECRET_NAME
from ca_server.kube.istiod_tls import SECRET_NAME as ISTIOD_TLS_SECRET
from ca_server.kube.secret_root import SECRET_NAME
from tests.support.deploy_rbac import Rule, authorized_name, granting_rule, required_rule
from tests.support.kube_api import RequestRecord

CA_NAMESPACE = "istio-system"
# The signer name deploy/overlays/pod-certificates configures (`--pod-certificate-signer`,
# docs/pod-certificates.md, docs/trust-bundles.md): an operator replaces it with a domain of theirs.
POD_CERTIFICATE_SIGNER = "meshca.example.com/spiffe"
# Where an xdist worker hands the rules its Kubernetes tests needed to the controller.
RBAC_NEEDED_KEY = "meshca_k8s_rbac_needed"

CA_RBAC: frozenset[Rule] = frozenset(
    [
        # TokenReview authenticator.
        Rule("authentication.k8s.io", "tokenreviews", "create", "cluster"),
        # Authority slots (Secret istio-ca-secret, CA namespace): read, watch, update on each
        # rotation step or `meshca authority` command — that one Secret only (the CA may not
        # read `cacerts`, the plugged-in CA's key, which reaches it as a mounted volume) — and
        # create once (RBAC cannot limit a create to a name).
        *(
            Rule("", "secrets", verb, "namespace", SECRET_NAME)
            for verb in ("get", "list", "watch", "update")
        ),
        Rule("", "secrets", "create", "namespace"),
        # istiod's serving certificate (Secret istiod-tls, istiod's namespace = the CA's in
        # deploy/): read by name at each pass and updated on renewal or a bundle change; created
        # with the create above.
        *(Rule("", "secrets", verb, "namespace", ISTIOD_TLS_SECRET) for verb in ("get", "update")),
        # JWT-SVID keys (Secret meshca-jwt-keys, CA namespace): read each poll, updated on each
        # rotation step; that one Secret only.
        *(Rule("", "secrets", verb, "namespace", JWT_SECRET_NAME) for verb in ("get", "update")),
        # Per-replica reports (ConfigMaps meshca-ca-replica-*, CA namespace): written with the
        # cluster-wide configmaps rules below; a replica deletes the spent report of a gone one.
        Rule("", "configmaps", "delete", "namespace"),
        # Root-publisher Lease (CA namespace).
        *(
            Rule("coordination.k8s.io", "leases", verb, "namespace")
            for verb in ("get", "create", "update")
        ),
        # Root ConfigMaps: watched cluster-wide, written in every namespace.
        *(
            Rule("", "configmaps", verb, "cluster")
            for verb in ("list", "watch", "create", "update")
        ),
        # Namespaces (each gets the root ConfigMap) and pods (node authorizer's cache, offline
        # token validation's bound-pod check).
        *(
            Rule("", resource, verb, "cluster")
            for resource in ("namespaces", "pods")
            for verb in ("list", "watch")
        ),
        # Offline token validation: the token's ServiceAccount (exists, with the token's uid).
        *(Rule("", "serviceaccounts", verb, "cluster") for verb in ("list", "watch")),
        # Offline token validation: the service-account issuer and its keys (non-resource
        # URLs, as in the built-in ClusterRole system:service-account-issuer-discovery).
        *(
            Rule("", url, "get", "cluster")
            for url in ("/.well-known/openid-configuration", "/openid/v1/jwks")
        ),
    ]
)

# What `--pod-certificate-signer` needs, for the signer name deploy/ uses; granted by
# deploy/overlays/pod-certificates (a ClusterRole of its own, so a cluster without the signer
# grants none of it) beside `CA_RBAC`. The signer (`ca_server.kube.pod_certificates`): list/watch
# the requests, update their status, and `sign` for that name (not a call meshca makes: the API
# server checks it on each status update). Its roots as ClusterTrustBundles
# (`ca_server.kube.trust_bundles`): watched (field selector spec.signerName), one created per
# root, relabelled through a rotation, restored when edited, deleted when the root leaves the
# bundle or meshca does not want it; writing one with a signer needs `attest` on that signer
# (the API server's ClusterTrustBundleAttest admission, not a call of its own either).
# Exercised by tests/k8s_real (test_pod_certificates, test_trust_bundles, test_least_privilege).
POD_CERTIFICATE_RBAC: frozenset[Rule] = frozenset(
    [
        *(
            Rule("certificates.k8s.io", "podcertificaterequests", verb, "cluster")
            for verb in ("list", "watch")
        ),
        Rule("certificates.k8s.io", "podcertificaterequests/status", "update", "cluster"),
        Rule("certificates.k8s.io", "signers", "sign", "cluster", POD_CERTIFICATE_SIGNER),
        *(
            Rule("certificates.k8s.io", "clustertrustbundles", verb, "cluster")
            for verb in ("list", "watch", "create", "update", "delete")
        ),
        Rule("certificates.k8s.io", "signers", "attest", "cluster", POD_CERTIFICATE_SIGNER),
    ]
)

# The node agent lists and watches the pods on its node (a field selector RBAC cannot express).
NODE_AGENT_RBAC: frozenset[Rule] = frozenset(
    Rule("", "pods", verb, "cluster") for verb in ("list", "watch")
)


ATTEST_REFUSAL = "user not permitted to attest for signerName"
"""How the API server words a ClusterTrustBundle write refused for want of `attest`."""


def attest_rule(bundle_name: str | None) -> Rule | None:
    """The `attest` a write of the ClusterTrustBundle `bundle_name` needs (its ClusterTrust-
    BundleAttest admission check, which the audit log does not show on its own): on the signer
    its name begins with (`<signer, / → :>:<rest>`, as the API server reads it back); None for
    a bundle without a signer."""
    if not bundle_name or ":" not in bundle_name:
        return None
    signer = bundle_name.rsplit(":", 1)[0].replace(":", "/")
    return Rule("certificates.k8s.io", "signers", "attest", "cluster", signer)


def api_group_of(path: str) -> str:
    """`/apis/<group>/<version>/...` → group; `/api/v1/...` → "" (core)."""
    segments = [s for s in path.split("?")[0].split("/") if s]
    return segments[1] if segments and segments[0] == "apis" else ""


def required_rules(records: Iterable[RequestRecord], home_namespace: str) -> set[Rule]:
    """The narrowest rules that allow the recorded requests of an account in `home_namespace`
    (each limited to the object the API server's authorizer would see it name)."""
    rules = set()
    for r in records:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(r.path).query))
        name = authorized_name(r.verb, r.name, query.get("fieldSelector"))
        group = api_group_of(r.path)
        rules.add(required_rule(group, r.resource, r.verb, r.namespace, home_namespace, name))
    return rules


def contract_rules(contract: Iterable[Rule], needed: Iterable[Rule]) -> set[Rule]:
    """The rules of `contract` that allow `needed` (a rule it does not allow stays as it is):
    what to compare with the contract to find what was granted and never used."""
    rules = set(contract)
    return {granting_rule(rules, rule) or rule for rule in needed}


def describe(rules: Iterable[Rule]) -> list[str]:
    """Rules grouped as `scope group/resource[name]: verbs`, one line per resource (and name)."""
    grouped: dict[tuple[str, str, str, str], set[str]] = {}
    for rule in rules:
        key = (rule.scope, rule.api_group, rule.resource, rule.name)
        grouped.setdefault(key, set()).add(rule.verb)
    return [
        f"{scope} {group or 'core'}/{resource}{f'[{name}]' if name else ''}: "
        f"{', '.join(sorted(verbs))}"
        for (scope, group, resource, name), verbs in sorted(grouped.items())
    ]


if __name__ == "__main__":
    print("CA:\n  " + "\n  ".join(describe(CA_RBAC | POD_CERTIFICATE_RBAC)))
    print("node agent:\n  " + "\n  ".join(describe(NODE_AGENT_RBAC)))
