"""The Helm chart deploy/helm/meshca, rendered by the real `helm`: lint passes, the schema
refuses wrong values with Helm's own message, and the chart renders the same objects as the
kustomize directories it mirrors (the defaults: deploy/base; the node agent toggles: the
node-agent overlays; a required plugged-in CA: overlays/plugged-in-ca) — so deploy/ stays the
one reviewed source of each object, and the chart cannot drift from it unseen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.deploy_manifests import DEPLOY_DIR, render
from tests.support.helm import CHART_DIR, Helm

pytestmark = pytest.mark.process

PART_OF = {"app.kubernetes.io/part-of": "meshca"}
SCHEMA_REFUSAL = "values don't meet the specifications of the schema(s)"


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm"))


def _by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str | None, str], dict[str, Any]]:
    keyed = {}
    for obj in objects:
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        assert key not in keyed, f"rendered twice: {key}"
        keyed[key] = obj
    return keyed


def _kustomized(directory: Path) -> dict[tuple[str, str | None, str], dict[str, Any]]:
    """`render` plus what the `labels` transformer of deploy/ adds (metadata labels only:
    includeSelectors is false there)."""
    objects = render(directory)
    for obj in objects:
        obj["metadata"]["labels"] = {**obj["metadata"].get("labels", {}), **PART_OF}
    return _by_key(objects)


def test_helm_lint_passes(helm: Helm):
    result = helm.run("lint", "--strict", str(CHART_DIR))
    assert "0 chart(s) failed" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("values", "kustomize_dir"),
    [
        ((), "base"),
        (("--set", "nodeAgent.enabled=true"), "overlays/node-agent"),
        (
            ("--set", "nodeAgent.enabled=true", "--set", "nodeAgent.workloadApi.enabled=true"),
            "overlays/node-agent-workload-api",
        ),
        (("--set", "pluggedInCa.required=true"), "overlays/plugged-in-ca"),
        (
            ("--set", "podCertificates.signer=meshca.example.com/spiffe"),
            "overlays/pod-certificates",
        ),
    ],
    ids=["defaults", "node-agent", "workload-api", "plugged-in-ca", "pod-certificates"],
)
def test_the_chart_renders_what_kustomize_renders(
    helm: Helm, values: tuple[str, ...], kustomize_dir: str
):
    from_helm = _by_key(helm.template(*values))
    from_kustomize = _kustomized(DEPLOY_DIR / kustomize_dir)
    assert sorted(from_helm) == sorted(from_kustomize)
    for key, obj in from_kustomize.items():
        assert from_helm[key] == obj, key


def test_istiod_in_another_namespace_gets_its_own_role(helm: Helm):
    values = ("--set", "istiodTls.namespace=istiod-ns", "--set", "istiodTls.revisions={canary}")
    objects = _by_key(helm.template(*values))
    role = objects[("Role", "istiod-ns", "meshca-istiod-tls")]
    assert {"resourceNames": ["istiod-tls"], "verbs": ["get", "update"]}.items() <= role["rules"][
        0
    ].items()
    binding = objects[("RoleBinding", "istiod-ns", "meshca-istiod-tls")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "meshca", "namespace": "istio-system"}
    ]
    home_rules = objects[("Role", "istio-system", "meshca")]["rules"]
    assert not [r for r in home_rules if "istiod-tls" in r.get("resourceNames", [])]
    args = objects[("Deployment", "istio-system", "meshca")]["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--istiod-namespace=istiod-ns" in args and "--istiod-revisions=canary" in args


def test_values_change_what_they_name(helm: Helm):
    values = (
        *("--set", "replicaCount=3", "--set", "meshConfig.trustDomain=example.org"),
        *("--set", "caTrustedNodeAccounts=kube-system/ztunnel", "--set", "istiodTls.enabled=false"),
    )
    objects = _by_key(helm.template(*values))
    deployment = objects[("Deployment", "istio-system", "meshca")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert "--trust-domain=example.org" in container["args"]
    assert "--no-istiod-tls" in container["args"]
    assert {"name": "CA_TRUSTED_NODE_ACCOUNTS", "value": "kube-system/ztunnel"} in container["env"]
    role_rules = objects[("Role", "istio-system", "meshca")]["rules"]
    assert not [r for r in role_rules if "istiod-tls" in r.get("resourceNames", [])]


def test_pod_certificates_turn_on_the_signer_its_bundles_and_istio_s(helm: Helm):
    """Off by default, granting nothing; `signer` passes the flag and grants the signer's rules
    (as deploy/overlays/pod-certificates), `istioClusterTrustBundle` the Istio flag and `attest`
    on Istio's signer, also alone (the bundle rules without the signer's)."""
    sign = {"apiGroups": ["certificates.k8s.io"], "resources": ["signers"], "verbs": ["sign"]}
    attest = {**sign, "verbs": ["attest"]}

    def rendered(*values: str) -> tuple[list[str], list[dict[str, Any]] | None]:
        objects = _by_key(helm.template(*values))
        spec = objects[("Deployment", "istio-system", "meshca")]["spec"]["template"]["spec"]
        role = objects.get(("ClusterRole", None, "meshca-pod-certificates"))
        return spec["containers"][0]["args"], role["rules"] if role is not None else None

    args, rules = rendered()
    assert not [a for a in args if "pod-certificate-signer" in a or "cluster-trust-bundle" in a]
    assert rules is None
    args, rules = rendered(
        *("--set", "podCertificates.signer=ex.com/a"),
        *("--set", "podCertificates.istioClusterTrustBundle=true"),
    )
    assert "--pod-certificate-signer=ex.com/a" in args and "--istio-cluster-trust-bundle" in args
    assert rules is not None
    assert [r for r in rules if r.get("resources") == ["signers"]] == [
        {**sign, "resourceNames": ["ex.com/a"]},
        {**attest, "resourceNames": ["ex.com/a"]},
        {**attest, "resourceNames": ["istio.io/istiod-ca"]},
    ]
    args, rules = rendered("--set", "podCertificates.istioClusterTrustBundle=true")
    assert "--istio-cluster-trust-bundle" in args
    assert not [a for a in args if "pod-certificate-signer" in a]
    assert rules is not None
    assert [r["resources"] for r in rules] == [["clustertrustbundles"], ["signers"]]
    assert rules[1] == {**attest, "resourceNames": ["istio.io/istiod-ca"]}


BAD_VALUES = {
    "wrong type": ("replicaCount=two", "replicaCount"),
    "unknown key": ("replicas=3", "replicas"),
    "unknown nested key": ("istiodTls.secretName=mine", "secretName"),
    "not a boolean": ("istiodTls.enabled=yes", "enabled"),
    "not an account list": ("caTrustedNodeAccounts=ztunnel", "caTrustedNodeAccounts"),
    "not a pull policy": ("image.pullPolicy=Sometimes", "pullPolicy"),
    "not a signer name": ("podCertificates.signer=spiffe", "signer"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_the_schema_refuses_bad_values(helm: Helm, case: str):
    setting, named = BAD_VALUES[case]
    # --set-string keeps "two"/"yes" strings, as a values file would spell them.
    flag = "--set" if case in ("unknown key", "unknown nested key") else "--set-string"
    for command in ("template", "lint"):
        args = (
            (command, "meshca", str(CHART_DIR))
            if command == "template"
            else (command, str(CHART_DIR))
        )
        result = helm.run(*args, flag, setting, check=False)
        assert result.returncode != 0, f"{command} accepted {setting}"
        assert SCHEMA_REFUSAL in result.stderr + result.stdout, result.stderr
        assert named in result.stderr + result.stdout
