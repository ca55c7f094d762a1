"""Least privilege, proven on the real API server (issue 23, Done means 2).

deploy/'s RBAC is applied for a fresh account, with one rule removed per test: the component
that needs the rule must then fail loudly, its log (or the command's error) naming the missing
permission in the API server's own words (`cannot list resource "pods" in API group "" at the
cluster scope`), and the API server's audit log must show that exactly this rule was refused.
With every rule in place the same work succeeds with no refusal at all, and every rule of
tests/support/kube_api_calls.py (which deploy/ grants, tests/deploy/test_manifests.py) is used:
nothing is granted that nobody needs.

Four pieces of work cover every rule: the CA's default mode (TokenReview, the authority
Secret, root ConfigMaps under the Lease, its replica report, `meshca authority prepare` as the
CA's account, its roots as ClusterTrustBundles of deploy/'s signer), the CA with offline token
validation (pod and ServiceAccount informers, the issuer's keys), the node agent (pods on its
node), and the Pod Certificate signer (its requests, their status, `sign` on its name:
deploy/overlays/pod-certificates).
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import kubernetes.client
import kubernetes.config
import pytest
from kubernetes.client.exceptions import ApiException

from ca_server.kube.istiod_tls import SECRET_NAME as ISTIOD_TLS_SECRET
from ca_server.kube.replica_reports import LABELS as REPORT_LABELS
from ca_server.kube.replica_reports import report_name
from ca_server.kube.root_publisher import CONFIGMAP_NAME
from ca_server.kube.secret_root import SECRET_NAME
from ca_server.kube.trust_bundles import TRUST_LABEL, bundle_prefix
from tests.k8s_real.conftest import Account, api_calls, make_account, unique
from tests.support.authority_cli import cluster_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.deploy_rbac import Rule
from tests.support.kube_api_calls import (
    ATTEST_REFUSAL,
    CA_RBAC,
    NODE_AGENT_RBAC,
    POD_CERTIFICATE_RBAC,
    POD_CERTIFICATE_SIGNER,
    contract_rules,
    describe,
)
from tests.support.kube_mode import issue, spiffe
from tests.support.kubelet_pcr import (
    create_pcr,
    generate_key,
    outcome,
    pcr_body,
    pod_body,
    read_pcr,
)
from tests.support.pki import TestCa
from tests.support.processes import MeshcaProcess, free_port, http_status, wait_for
from tests.support.real_kube import RealControlPlane

DISCOVERY_BINDING = "system:service-account-issuer-discovery"
TRUST_BUNDLE_DISCOVERY_BINDING = "system:cluster-trust-bundle-discovery"
SECRETS = ("cacerts", "other")  # Secrets beside istio-ca-secret in the CA's namespace


@dataclass
class Work:
    """One run of a component's work as `account`; `output()` is all it said."""

    plane: RealControlPlane
    account: Account
    directory: Path
    expected: str | None = None  # the refusal the test waits for (None: all rules granted)
    processes: list[MeshcaProcess] = field(default_factory=list)
    said: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "\n".join([*(p.log() for p in self.processes), *self.said])

    def ca(self, *args: str) -> CaProcess:
        ca = CaProcess(
            self.directory / "ca",
            "--kubeconfig",
            str(self.account.kubeconfig),
            "--namespace",
            self.account.namespace,
            "--instance-id",
            "ca-0",
            "--ca-reload-interval",
            "500ms",
            *args,
        )
        self.processes.append(ca)
        ca.launch()
        return ca

    def ready(self, ca: CaProcess) -> bool:
        """Whether the CA became ready; False as soon as it exited or said `expected` (a CA
        refused at start-up may wait long for a cache that cannot fill)."""

        def settled() -> bool:
            return (
                not ca.running
                or (self.expected is not None and self.expected in self.output())
                or http_status(f"{ca.monitoring_url}/ready") == 200
            )

        try:
            wait_for(settled, 20, "the CA to become ready or fail", 0.1)
        except TimeoutError:
            return False
        return ca.running and http_status(f"{ca.monitoring_url}/ready") == 200

    def workload_token(self) -> tuple[str, str]:
        namespace = unique("app")
        self.plane.create_namespace(namespace)
        self.plane.create_service_account(namespace, "cart")
        pod = self.plane.create_pod(namespace, unique("cart"), "cart")
        token = self.plane.request_token(namespace, "cart", audiences=("istio-ca",), pod=pod)
        return token, spiffe(namespace, "cart")

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def ca_default_mode(work: Work) -> Callable[[], bool]:
    """TokenReview, the authority Secret (read, create, watch; updated by `meshca authority
    prepare` run as the CA's account), the JWT-SVID keys' Secret (read, create; updated by
    `meshca authority prepare --jwt`), root ConfigMaps (one stale copy to update) under the
    Lease, the replica report (a gone replica's spent one to delete), istiod's Secret
    istiod-tls (created, then updated when `prepare` adds a root to its ca.crt), and the
    ClusterTrustBundles of deploy/'s signer (a planted one to delete, the CA's own created,
    then edited by someone else and restored; `prepare` adds one)."""
    core = work.plane.core
    bundles: Any = kubernetes.client.CertificatesV1Api(work.plane.admin())
    for stale_bundle in _signer_bundles(bundles):
        bundles.delete_cluster_trust_bundle(stale_bundle.metadata.name)
    planted = bundle_prefix(POD_CERTIFICATE_SIGNER) + unique("planted")
    bundles.create_cluster_trust_bundle(
        kubernetes.client.V1ClusterTrustBundle(
            metadata=kubernetes.client.V1ObjectMeta(name=planted),
            spec=kubernetes.client.V1ClusterTrustBundleSpec(
                signer_name=POD_CERTIFICATE_SIGNER, trust_bundle=_any_root_pem()
            ),
        )
    )
    stale = unique("stale")
    work.plane.create_namespace(stale)
    core.create_namespaced_config_map(
        stale,
        kubernetes.client.V1ConfigMap(
            metadata=kubernetes.client.V1ObjectMeta(name=CONFIGMAP_NAME),
            data={"root-cert.pem": "an old root"},
        ),
    )
    gone = report_name("ca-gone")
    core.create_namespaced_config_map(
        work.account.namespace,
        kubernetes.client.V1ConfigMap(
            metadata=kubernetes.client.V1ObjectMeta(name=gone, labels=dict(REPORT_LABELS)),
            data={"leaves.json": json.dumps({"0" * 40: {"1000": 7}})},
        ),
    )
    ca = work.ca("--pod-certificate-signer", POD_CERTIFICATE_SIGNER)
    if not work.ready(ca):
        return lambda: False
    edited = _edit_own_bundle(work, bundles)
    token, identity = work.workload_token()
    try:
        issued = len(issue(ca, token, identity)) == 2
    except grpc.RpcError as error:
        issued = False
        work.said.append(f"CreateCertificate: {error.code().name}: {error.details()}")
    result = meshca_authority(
        cluster_target(work.account.kubeconfig, work.account.namespace), "prepare"
    )
    work.said.append(f"meshca authority prepare (exit {result.returncode}): {result.stderr}")
    jwt_result = meshca_authority(
        cluster_target(work.account.kubeconfig, work.account.namespace), "prepare", "--jwt"
    )
    work.said.append(
        f"meshca authority prepare --jwt (exit {jwt_result.returncode}): {jwt_result.stderr}"
    )

    def done() -> bool:
        """Everything the CA does in this mode has happened (with all rules in place)."""
        try:
            core.read_namespaced_config_map(gone, work.account.namespace)
            return False
        except ApiException as exc:
            if exc.status != 404:
                raise
        current = core.read_namespaced_config_map(CONFIGMAP_NAME, stale)
        lease_api: Any = kubernetes.client.CoordinationV1Api(work.plane.admin())
        leases = lease_api.list_namespaced_lease(work.account.namespace)
        renewed = any(
            lease.spec.renew_time and lease.spec.acquire_time != lease.spec.renew_time
            for lease in leases.items
        )
        published = (current.data or {}).get("root-cert.pem", "")
        try:
            istiod = core.read_namespaced_secret(ISTIOD_TLS_SECRET, work.account.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False
        istiod_bundle = base64.b64decode((istiod.data or {}).get("ca.crt", "")).decode()
        own = [b for b in _signer_bundles(bundles) if b.metadata.name != planted]
        restored = edited and all((b.metadata.labels or {}).get(TRUST_LABEL) for b in own)
        return (
            issued
            and restored
            and len(own) == 2  # the active root's and the prepared one's; the planted one gone
            and len(_signer_bundles(bundles)) == 2
            and result.returncode == 0
            and jwt_result.returncode == 0
            and renewed
            and published.startswith("-----BEGIN CERTIFICATE-----")
            and istiod_bundle.count("BEGIN CERTIFICATE") == 2  # updated after `prepare`
        )

    return done


def _signer_bundles(bundles: Any) -> list[Any]:
    return list(
        bundles.list_cluster_trust_bundle(
            field_selector=f"spec.signerName={POD_CERTIFICATE_SIGNER}"
        ).items
    )


def _any_root_pem() -> str:
    return TestCa().root_pem


def _edit_own_bundle(work: Work, bundles: Any) -> bool:
    """Once the CA's own bundle exists, takes its trust label off (as someone else could): the
    CA must update it back. False if it never appeared (its create or attest refused)."""

    def appeared() -> bool:
        own = _signer_bundles(bundles)
        if any((b.metadata.labels or {}).get(TRUST_LABEL) for b in own):
            return True
        return work.expected is not None and work.expected in work.output()

    try:
        wait_for(appeared, 15, "the CA's ClusterTrustBundle", 0.1)
    except TimeoutError:
        return False
    for bundle in _signer_bundles(bundles):
        if (bundle.metadata.labels or {}).get(TRUST_LABEL):
            bundle.metadata.labels = {"edited": "by-someone"}
            bundles.replace_cluster_trust_bundle(bundle.metadata.name, bundle)
            return True
    return False


def ca_offline_validation(work: Work, *flags: str) -> Callable[[], bool]:
    ca = work.ca("--no-root-configmaps", "--token-validation", "offline", *flags)
    if not work.ready(ca):
        return lambda: False
    token, identity = work.workload_token()
    try:
        issue(ca, token, identity)
    except grpc.RpcError as error:
        work.said.append(f"CreateCertificate: {error.code().name}: {error.details()}")
        return lambda: False
    return lambda: True


def ca_offline_validation_paged(work: Work) -> Callable[[], bool]:
    """Offline validation with the caches listed in pages, as against an API server without
    watch-list: the only work that lists pods and ServiceAccounts (the default streams them,
    which the API server authorizes as a watch)."""
    return ca_offline_validation(work, "--no-kube-stream-lists")


def node_agent(work: Work) -> Callable[[], bool]:
    node = unique("node")
    namespace = unique("app")
    work.plane.create_namespace(namespace)
    work.plane.create_service_account(namespace, "cart")
    work.plane.create_pod(namespace, "cart-1", "cart", node)
    # The CA it would talk to is not needed to watch pods: the pod list is the node agent's own.
    output = work.directory / "certs"
    (work.directory / "token").write_text("unused")
    agent = MeshcaProcess(
        [
            "agent",
            "--node-mode",
            "--node-name",
            node,
            "--kubeconfig",
            str(work.account.kubeconfig),
            "--ca-addr",
            f"127.0.0.1:{free_port()}",
            "--token-file",
            str(work.directory / "token"),
            "--sds-socket",
            str(work.directory / "sds.sock"),
            "--output-dir",
            str(output),
            "--status-listen",
            f"127.0.0.1:{free_port()}",
        ],
        work.directory / "agent.log",
    )
    work.processes.append(agent)
    agent.start()
    username = f"system:serviceaccount:{work.account.namespace}:{work.account.name}"

    def watching() -> bool:
        verbs = {e["verb"] for e in work.plane.audit_events(username)}
        return {"list", "watch"} <= verbs

    return watching


def ca_pod_certificates(work: Work) -> Callable[[], bool]:
    """The Pod Certificate signer: a pod with a podCertificate volume for deploy/'s signer name,
    a request for it (created as the admin: this plane runs no Node authorizer), answered
    `Issued` under the Lease."""
    namespace = unique("app")
    work.plane.create_namespace(namespace)
    work.plane.create_service_account(namespace, "cart")
    node = work.plane.ensure_node("node-pc")
    pod = work.plane.core.create_namespaced_pod(
        namespace, pod_body(namespace, "cart-1", "cart", "node-pc", POD_CERTIFICATE_SIGNER)
    )
    ca = work.ca(
        "--no-root-configmaps",
        "--no-istiod-tls",
        "--pod-certificate-signer",
        POD_CERTIFICATE_SIGNER,
    )
    if not work.ready(ca):
        return lambda: False
    account_uid = work.plane.core.read_namespaced_service_account("cart", namespace).metadata.uid
    body = pcr_body(pod, account_uid, node, POD_CERTIFICATE_SIGNER, generate_key("ECDSAP256"))
    name = create_pcr(work.plane.admin(), body)["metadata"]["name"]
    return lambda: outcome(read_pcr(work.plane.admin(), namespace, name)) == "Issued"


WorkFn = Callable[[Work], Callable[[], bool]]
# `sign` on the signer name is no call of meshca's: the API server checks it when the signer
# writes a status, and refuses that write with 422 (not 403) naming the permission.
SIGN_RULE = next(rule for rule in POD_CERTIFICATE_RBAC if rule.verb == "sign")

# Which work needs which rule; the expected failure is in the server's words.
CA_WORK: dict[Rule, WorkFn] = {
    **{rule: ca_default_mode for rule in CA_RBAC},
    **{
        rule: ca_offline_validation
        for rule in CA_RBAC
        if rule.resource in ("pods", "serviceaccounts") or rule.resource.startswith("/")
    },
    **{
        rule: ca_offline_validation_paged
        for rule in CA_RBAC
        if rule.resource in ("pods", "serviceaccounts") and rule.verb == "list"
    },
    # The signer's requests and `sign`; its ClusterTrustBundles (and `attest`) are written in the
    # default mode's work, which turns the signer on and plants and edits a bundle.
    **{
        rule: (
            ca_pod_certificates
            if rule.resource.startswith("podcertificaterequests") or rule == SIGN_RULE
            else ca_default_mode
        )
        for rule in POD_CERTIFICATE_RBAC
    },
}
CASES = [
    *((rule, "meshca", work) for rule, work in sorted(CA_WORK.items())),
    *((rule, "meshca-node-agent", node_agent) for rule in sorted(NODE_AGENT_RBAC)),
]


def refusal_text(rule: Rule) -> str:
    """How the API server words a refusal of `rule` (pkg/registry/rbac, authorizer)."""
    if rule == SIGN_RULE:
        return f'is not permitted to "sign" for signer "{rule.name}"'
    if rule.resource.startswith("/"):
        return f'cannot {rule.verb} path "{rule.resource}"'
    if rule.verb == "attest":
        return f'{ATTEST_REFUSAL} "{rule.name}"'
    return f'cannot {rule.verb} resource "{rule.resource}" in API group "{rule.api_group}"'


def _as_granted(rule: Rule) -> Rule:
    """The contract's rule for a call: a call in the account's own namespace counts against a
    cluster grant of the same verb when deploy/ grants only that (e.g. its replica report is
    written with the ClusterRole), a call naming an object against a grant for any name."""
    (granted,) = contract_rules(CA_RBAC | NODE_AGENT_RBAC | POD_CERTIFICATE_RBAC, [rule])
    return granted


def _case_id(case: tuple[Rule, str, WorkFn]) -> str:
    rule, account, _ = case
    name = f"[{rule.name}]" if rule.name else ""
    return f"{account}:{rule.scope}:{rule.api_group or 'core'}/{rule.resource}{name}:{rule.verb}"


def _without_binding(plane: RealControlPlane, name: str) -> Iterator[None]:
    api: Any = kubernetes.client.RbacAuthorizationV1Api(plane.admin())
    saved = api.read_cluster_role_binding(name)
    api.delete_cluster_role_binding(name)
    try:
        yield
    finally:
        saved.metadata = kubernetes.client.V1ObjectMeta(
            name=name,
            labels=saved.metadata.labels,
            annotations=saved.metadata.annotations,
        )
        api.create_cluster_role_binding(saved)


@pytest.fixture
def without_default_discovery_binding(control_plane: RealControlPlane) -> Iterator[None]:
    """Kubernetes binds the issuer-discovery URLs to every ServiceAccount by default
    (ClusterRoleBinding system:service-account-issuer-discovery); a cluster may drop that
    binding, and then deploy/'s own rule is what lets offline validation read the keys."""
    yield from _without_binding(control_plane, DISCOVERY_BINDING)


@pytest.fixture
def without_default_trust_bundle_binding(control_plane: RealControlPlane) -> Iterator[None]:
    """Likewise, every ServiceAccount may read ClusterTrustBundles by default
    (ClusterRoleBinding system:cluster-trust-bundle-discovery); without it, deploy/'s list and
    watch are what let the CA see its bundles."""
    yield from _without_binding(control_plane, TRUST_BUNDLE_DISCOVERY_BINDING)


@pytest.mark.parametrize(("rule", "account", "work_fn"), CASES, ids=[_case_id(c) for c in CASES])
def test_each_rule_is_needed_and_its_absence_fails_loudly(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    control_plane: RealControlPlane,
    rule: Rule,
    account: str,
    work_fn: WorkFn,
):
    if rule.resource.startswith("/"):
        request.getfixturevalue("without_default_discovery_binding")
    if rule.resource == "clustertrustbundles" and rule.verb in ("list", "watch"):
        request.getfixturevalue("without_default_trust_bundle_binding")
    grant = make_account(control_plane, tmp_path / "account", deploy_account=account, drop=rule)
    expected = refusal_text(rule)
    work = Work(control_plane, grant, tmp_path, expected)
    try:
        work_fn(work)
        wait_for(lambda: expected in work.output(), 30, f"an error naming {expected!r}", 0.2)
        refused = {_as_granted(r) for r, code in api_calls(control_plane, grant) if code == 403}
        assert refused == ({rule} if rule != SIGN_RULE else set()), f"refused: {describe(refused)}"
    finally:
        work.stop()
        grant.rbac.delete(control_plane)


def test_with_every_rule_the_work_succeeds_and_every_rule_is_used(
    tmp_path: Path, control_plane: RealControlPlane
):
    used: set[Rule] = set()
    for name, account, work_fn in (
        ("default", "meshca", ca_default_mode),
        ("offline", "meshca", ca_offline_validation),
        ("offline-paged", "meshca", ca_offline_validation_paged),
        ("node", "meshca-node-agent", node_agent),
        ("pod-certificates", "meshca", ca_pod_certificates),
    ):
        grant = make_account(control_plane, tmp_path / name, deploy_account=account)
        work = Work(control_plane, grant, tmp_path / name)
        try:
            done = work_fn(work)
            wait_for(done, 30, f"{name}: the work to complete", 0.2)
            calls = api_calls(control_plane, grant)
            refused = {r for r, code in calls if code == 403}
            assert not refused, f"{name}: refused {describe(refused)}\n{work.output()[-3000:]}"
            used |= {_as_granted(r) for r, _ in calls}
            if work_fn is ca_pod_certificates:
                used.add(SIGN_RULE)  # the API server accepted the Issued status
        finally:
            work.stop()
            grant.rbac.delete(control_plane)
    granted = set(CA_RBAC) | set(NODE_AGENT_RBAC) | set(POD_CERTIFICATE_RBAC)
    assert used <= granted, f"outside the contract: {describe(used - granted)}"
    assert not granted - used, f"granted but never needed: {describe(granted - used)}"


def test_the_ca_can_touch_no_secret_but_its_own(tmp_path: Path, control_plane: RealControlPlane):
    """deploy/'s RBAC lets the CA's account read, list, watch and update Secret istio-ca-secret
    and create Secrets, and nothing else among the Secrets of its namespace: not `cacerts` (the
    plugged-in CA's private key, which the CA reads from its volume), not any other. Asked of
    the authorizer (SubjectAccessReview) and tried as the account. (With all of it the CA does
    its work: `test_with_every_rule_the_work_succeeds_and_every_rule_is_used`.) Before: the Role
    granted get/list/watch/update on every Secret of the namespace."""
    grant = make_account(control_plane, tmp_path)
    namespace = grant.namespace
    for name in SECRETS:
        control_plane.core.create_namespaced_secret(
            namespace,
            kubernetes.client.V1Secret(
                metadata=kubernetes.client.V1ObjectMeta(name=name),
                string_data={"ca-key.pem": "the plugged-in CA's key"},
            ),
        )
    authorization: Any = kubernetes.client.AuthorizationV1Api(control_plane.admin())

    def allowed(verb: str, name: str | None = None) -> bool:
        review = kubernetes.client.V1SubjectAccessReview(
            spec=kubernetes.client.V1SubjectAccessReviewSpec(
                user=f"system:serviceaccount:{namespace}:{grant.name}",
                groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                resource_attributes=kubernetes.client.V1ResourceAttributes(
                    resource="secrets", verb=verb, namespace=namespace, name=name
                ),
            )
        )
        return bool(authorization.create_subject_access_review(review).status.allowed)

    try:
        granted: list[tuple[str, str | None]] = [
            *((verb, SECRET_NAME) for verb in ("get", "list", "watch", "update")),
            ("create", None),
        ]
        assert [case for case in granted if not allowed(*case)] == []
        refused: list[tuple[str, str | None]] = [
            *((verb, name) for verb in ("get", "update", "delete") for name in SECRETS),
            *((verb, name) for verb in ("list", "watch") for name in (None, "cacerts")),
            ("delete", SECRET_NAME),
            ("patch", SECRET_NAME),
        ]
        assert [case for case in refused if allowed(*case)] == []

        with kubernetes.config.new_client_from_config(str(grant.kubeconfig)) as api:
            as_ca: Any = kubernetes.client.CoreV1Api(api)
            attempts: dict[str, Callable[[], Any]] = {
                **{
                    f"get {name}": functools.partial(as_ca.read_namespaced_secret, name, namespace)
                    for name in SECRETS
                },
                "list all": functools.partial(as_ca.list_namespaced_secret, namespace),
                "list cacerts": functools.partial(
                    as_ca.list_namespaced_secret, namespace, field_selector="metadata.name=cacerts"
                ),
            }
            statuses = {}
            for what, attempt in attempts.items():
                with pytest.raises(ApiException) as refusal:
                    attempt()
                statuses[what] = refusal.value.status
            assert set(statuses.values()) == {403}, statuses
            own = as_ca.list_namespaced_secret(
                namespace, field_selector=f"metadata.name={SECRET_NAME}"
            )
            assert own.items == []  # allowed: the CA has not created it here
    finally:
        grant.rbac.delete(control_plane)
