"""meshca as a Pod Certificate signer, against the real kube-apiserver run as production runs it:
`--authorization-mode=Node,RBAC` and the NodeRestriction admission plugin, with a client playing
the kubelet as `system:node:<name>` (issue 31, Done means 1 and 3).

One control plane for this module (the Node authorizer is not on the session's), one CA
account with deploy/'s RBAC (the pod-certificates overlay's rules included) and one CA. Each
test creates its own pods; the kubelet's requests go through the API server's own checks
(stub CSR signature, key type, NodeRestriction) before meshca sees them, and meshca's answers
through the API server's status validation — so every status asserted here is one the API
server accepted.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from cryptography import x509
from kubernetes.client.exceptions import ApiException

from certs import verify_chain
from tests.k8s_real.conftest import Account, assert_calls_within_contract, make_account
from tests.support.authority_cli import authority_rows, cluster_target
from tests.support.ca_process import CaProcess
from tests.support.deploy_rbac import Rule
from tests.support.kube_api_calls import CA_RBAC, POD_CERTIFICATE_RBAC, POD_CERTIFICATE_SIGNER
from tests.support.kubelet_pcr import (
    condition,
    create_pcr,
    generate_key,
    outcome,
    pcr_body,
    pod_body,
    wait_answered,
)
from tests.support.metrics import sample_value
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane
from tests.support.trust_selection import SelectionWatch, selected_ids, selected_roots

NODE, OTHER_NODE = "node-pc", "node-other"
SIGNER = POD_CERTIFICATE_SIGNER
_names = itertools.count(1)


@pytest.fixture(scope="module")
def plane(starts_processes: None) -> Iterator[RealControlPlane]:
    control = RealControlPlane(node_authorization=True).start()
    try:
        yield control
    finally:
        control.stop()


@pytest.fixture(scope="module")
def account(plane: RealControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Account:
    return make_account(plane, tmp_path_factory.mktemp("pcr-account"))


@pytest.fixture(scope="module")
def kubelet(plane: RealControlPlane) -> Iterator[kubernetes.client.ApiClient]:
    plane.ensure_node(NODE)
    plane.ensure_node(OTHER_NODE)
    api = plane.client_as(f"system:node:{NODE}", "system:nodes")
    try:
        yield api
    finally:
        api.close()


def start_ca(plane: RealControlPlane, account: Account, directory: Path, name: str) -> CaProcess:
    ca = CaProcess(
        directory / name,
        *("--kubeconfig", str(account.kubeconfig), "--namespace", account.namespace),
        *("--instance-id", name, "--pod-certificate-signer", SIGNER),
        *("--no-root-configmaps", "--no-istiod-tls"),
    )
    ca.start()
    return ca


@pytest.fixture(scope="module")
def ca(
    plane: RealControlPlane, account: Account, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CaProcess]:
    ca = start_ca(plane, account, tmp_path_factory.mktemp("pcr-ca"), "ca-0")
    try:
        yield ca
    finally:
        ca.stop()
        assert_calls_within_contract(plane, account, CA_RBAC | POD_CERTIFICATE_RBAC)


@pytest.fixture(scope="module")
def shop(plane: RealControlPlane) -> str:
    namespace = f"shop-{next(_names)}"
    plane.create_namespace(namespace)
    plane.create_service_account(namespace, "cart")
    plane.create_service_account(namespace, "admin")
    return namespace


def make_pod(
    plane: RealControlPlane,
    namespace: str,
    *,
    account: str = "cart",
    node: str = NODE,
    signer: str | None = SIGNER,
    key_type: str = "ECDSAP256",
) -> Any:
    name = f"pod-{next(_names)}"
    body = pod_body(namespace, name, account, node, signer, key_type)
    return plane.core.create_namespaced_pod(namespace, body)


def account_uid(plane: RealControlPlane, namespace: str, name: str) -> str:
    return str(plane.core.read_namespaced_service_account(name, namespace).metadata.uid)


def request(
    plane: RealControlPlane,
    api: kubernetes.client.ApiClient,
    pod: Any,
    key_type: str,
    signer: str = SIGNER,
    **changes: Any,
) -> tuple[Any, dict[str, Any]]:
    """(key, the created request) for `pod` on its node, as `api` creates it; `changes` replace
    spec fields (what a lying creator sends)."""
    key = generate_key(key_type)
    node = plane.core.read_node(pod.spec.node_name)
    uid = account_uid(plane, pod.metadata.namespace, pod.spec.service_account_name)
    body = pcr_body(pod, uid, node, signer, key)
    body["spec"].update(changes)
    return key, create_pcr(api, body)


def answered(plane: RealControlPlane, pcr: dict[str, Any]) -> dict[str, Any]:
    """The request once answered, read as the admin (the Node authorizer lets a node read a
    request only once its graph has linked them, a moment after the create)."""
    meta = pcr["metadata"]
    return wait_answered(plane.admin(), meta["namespace"], meta["name"])


def chain_of(pcr: dict[str, Any]) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pcr["status"]["certificateChain"].encode())


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.mark.parametrize("key_type", ["RSA3072", "RSA4096", "ECDSAP256", "ECDSAP384"])
def test_each_key_type_meshca_signs_is_issued_and_verifies_to_the_root(
    plane: RealControlPlane,
    kubelet: kubernetes.client.ApiClient,
    ca: CaProcess,
    shop: str,
    key_type: str,
) -> None:
    pod = make_pod(plane, shop, key_type=key_type)
    key, pcr = request(plane, kubelet, pod, key_type)
    done = answered(plane, pcr)
    cond = condition(done)
    assert cond is not None and cond["type"] == "Issued", cond
    leaf, *rest = chain_of(done)
    root = x509.load_pem_x509_certificate(ca.root_cert_path.read_bytes())
    assert rest == []  # self-signed slots: the leaf alone, the root comes from the bundles
    leaf.verify_directly_issued_by(root)
    assert leaf.public_key() == key.public_key()
    uris = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert uris.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"spiffe://cluster.local/ns/{shop}/sa/cart"
    ]
    status = done["status"]
    not_before, not_after = parse_time(status["notBefore"]), parse_time(status["notAfter"])
    refresh = parse_time(status["beginRefreshAt"])
    assert (not_before, not_after) == (leaf.not_valid_before_utc, leaf.not_valid_after_utc)
    assert not_after - not_before <= timedelta(seconds=86400)
    assert not_before + timedelta(minutes=10) <= refresh <= not_after - timedelta(minutes=10)


@pytest.mark.parametrize(
    ("key_type", "named"), [("ECDSAP521", "secp521r1"), ("ED25519", "Ed25519")]
)
def test_key_types_the_api_allows_but_meshca_does_not_sign_are_denied(
    plane: RealControlPlane,
    kubelet: kubernetes.client.ApiClient,
    ca: CaProcess,
    shop: str,
    key_type: str,
    named: str,
) -> None:
    pod = make_pod(plane, shop, key_type=key_type)
    _, pcr = request(plane, kubelet, pod, key_type)
    done = answered(plane, pcr)
    cond = condition(done)
    assert cond is not None and cond["type"] == "Denied", cond
    assert cond["reason"] == "UnsupportedKeyType"
    assert named in cond["message"] and "ECDSAP256" in cond["message"]
    assert "certificateChain" not in done["status"]


def test_the_api_server_itself_refuses_rsa_2048(
    plane: RealControlPlane, kubelet: kubernetes.client.ApiClient, shop: str
) -> None:
    pod = make_pod(plane, shop)
    with pytest.raises(ApiException) as refused:
        request(plane, kubelet, pod, "RSA2048")
    assert refused.value.status == 422
    assert "RSA keys must have modulus size 3072 or 4096" in str(refused.value.body)


def test_noderestriction_refuses_a_node_asking_for_another_nodes_pod(
    plane: RealControlPlane, kubelet: kubernetes.client.ApiClient, shop: str
) -> None:
    pod = make_pod(plane, shop, node=OTHER_NODE)
    with pytest.raises(ApiException) as refused:
        request(plane, kubelet, pod, "ECDSAP256")
    assert refused.value.status == 403
    assert "which is not the requesting node" in str(refused.value.body)
    # ... and a pod on its own node without a volume for the signer.
    bare = make_pod(plane, shop, signer=None)
    with pytest.raises(ApiException) as refused:
        request(plane, kubelet, bare, "ECDSAP256")
    assert "does not mount a podCertificate projected volume" in str(refused.value.body)


@pytest.fixture(scope="module")
def intruder(plane: RealControlPlane, shop: str) -> Iterator[kubernetes.client.ApiClient]:
    """A user who is not a node but may create PodCertificateRequests in the shop's namespace
    (a mistaken grant): NodeRestriction does not look at its requests at all."""
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(plane.admin())
    rule = {
        "apiGroups": ["certificates.k8s.io"],
        "resources": ["podcertificaterequests"],
        "verbs": ["create", "get"],
    }
    rbac.create_namespaced_role(
        shop, {"metadata": {"name": "pcr-creator", "namespace": shop}, "rules": [rule]}
    )
    rbac.create_namespaced_role_binding(
        shop,
        {
            "metadata": {"name": "pcr-creator", "namespace": shop},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pcr-creator",
            },
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "mallory"}
            ],
        },
    )
    api = plane.client_as("mallory")
    try:
        yield api
    finally:
        api.close()


def failed_with(plane: RealControlPlane, pcr: dict[str, Any], reason: str) -> str:
    done = answered(plane, pcr)
    cond = condition(done)
    assert cond is not None and cond["type"] == "Failed", cond
    assert cond["reason"] == reason, cond
    assert set(done["status"]) == {"conditions"}  # no chain, no times
    return str(cond["message"])


def test_requests_that_do_not_match_the_pod_fail_saying_what_differs(
    plane: RealControlPlane,
    intruder: kubernetes.client.ApiClient,
    ca: CaProcess,
    shop: str,
) -> None:
    victim = make_pod(plane, shop)
    bare = make_pod(plane, shop, signer=None)
    # A pod without the volume, asked for by someone NodeRestriction does not check.
    _, pcr = request(plane, intruder, bare, "ECDSAP256")
    assert "podCertificate projected volume" in failed_with(plane, pcr, "NoPodCertificateVolume")
    # Someone else's pod, claimed for another account (the identity the intruder wants).
    _, pcr = request(
        plane,
        intruder,
        victim,
        "ECDSAP256",
        serviceAccountName="admin",
        serviceAccountUID=account_uid(plane, shop, "admin"),
    )
    message = failed_with(plane, pcr, "ServiceAccountMismatch")
    assert "runs as service account cart" in message
    # Someone else's pod on another node than it runs on.
    other = plane.core.read_node(OTHER_NODE)
    _, pcr = request(
        plane, intruder, victim, "ECDSAP256", nodeName=OTHER_NODE, nodeUID=other.metadata.uid
    )
    assert f"bound to node {NODE}" in failed_with(plane, pcr, "NodeMismatch")


def test_a_wrong_pod_uid_fails_once_the_grace_for_a_new_pod_is_over(
    plane: RealControlPlane,
    intruder: kubernetes.client.ApiClient,
    ca: CaProcess,
    shop: str,
) -> None:
    victim = make_pod(plane, shop)
    _, pcr = request(plane, intruder, victim, "ECDSAP256", podUID="0000-not-the-pod")
    assert "the request names 0000-not-the-pod" in failed_with(plane, pcr, "PodUIDMismatch")


def test_a_hundred_requests_from_the_node_are_all_issued(
    plane: RealControlPlane,
    kubelet: kubernetes.client.ApiClient,
    ca: CaProcess,
    shop: str,
) -> None:
    """Done means 1 (the latency figure is bench/pod_certificates.py's): all Issued, each chain
    verifying to what a pod selects (the signer's ClusterTrustBundles labelled meshca.io/trust)
    and carrying the pod's SPIFFE ID."""
    bundles: Any = kubernetes.client.CertificatesV1Api(plane.admin())
    wait_for(lambda: selected_roots(bundles, SIGNER) != [], 10, "the CA's trust bundles")
    roots = selected_roots(bundles, SIGNER)
    pods = [make_pod(plane, shop) for _ in range(100)]
    uid = account_uid(plane, shop, "cart")
    node = plane.core.read_node(NODE)
    created = [
        create_pcr(kubelet, pcr_body(pod, uid, node, SIGNER, generate_key("ECDSAP256")))
        for pod in pods
    ]
    outcomes: Counter[str] = Counter()
    for pcr, pod in zip(created, pods, strict=True):
        done = answered(plane, pcr)
        outcomes[outcome(done)] += 1
        chain = chain_of(done)
        verify_chain(chain, roots, now=datetime.now(UTC))
        uris = chain[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert uris.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://cluster.local/ns/{shop}/sa/cart"
        ]
        assert done["spec"]["podUID"] == pod.metadata.uid
    assert outcomes == {"Issued": 100}


REPLICA_SIGNER = "meshca.example.com/replicas"
CONFLICT = {"outcome": "conflict"}


def sign_for(plane: RealControlPlane, account: Account, signer: str) -> frozenset[Rule]:
    """Lets `account` sign (and `attest`: its roots become that signer's ClusterTrustBundles)
    for a second signer name, beside deploy/'s; returns those rules, for the call contract."""
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(plane.admin())
    name = f"sign-{account.namespace}"
    rbac.create_cluster_role(
        {
            "metadata": {"name": name},
            "rules": [
                {
                    "apiGroups": ["certificates.k8s.io"],
                    "resources": ["signers"],
                    "resourceNames": [signer],
                    "verbs": ["sign", "attest"],
                }
            ],
        }
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": name,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": account.name, "namespace": account.namespace}
            ],
        }
    )
    return frozenset(
        Rule("certificates.k8s.io", "signers", verb, "cluster", signer)
        for verb in ("sign", "attest")
    )


def leader_of(replicas: list[CaProcess]) -> CaProcess:
    def leaders() -> list[CaProcess]:
        return [
            ca for ca in replicas
            if ca.running and sample_value(ca.metrics(), "meshca_ca_root_publisher_leader") == 1
        ]  # fmt: skip

    wait_for(lambda: len(leaders()) == 1, 30, "exactly one leader")
    return leaders()[0]


def audit_lines(ca: CaProcess) -> list[dict[str, Any]]:
    lines = []
    for line in ca.log().splitlines():
        if line.startswith("{") and '"msg": "pod-certificate"' in line:
            lines.append(json.loads(line))
    return lines


def test_two_replicas_one_killed_mid_stream_answer_every_request_once(
    plane: RealControlPlane,
    kubelet: kubernetes.client.ApiClient,
    tmp_path: Path,
) -> None:
    """Done means 3: the Lease holder signs; SIGKILLed (no release) once it has answered a few
    of a stream of requests, the other takes over at the Lease's expiry and lists what is
    pending. Every request ends Issued, its leaf signed once: each request's leaf is the one a
    replica's audit line names, no request has two `issued` lines, nothing else was logged (no
    conflict: no second write, not even a refused one) — except that the killed replica may
    have died between its status write and its audit line, for at most the one request it was
    answering."""
    account = make_account(plane, tmp_path / "account")
    granted = sign_for(plane, account, REPLICA_SIGNER)
    namespace = f"stream-{next(_names)}"
    plane.create_namespace(namespace)
    plane.create_service_account(namespace, "cart")
    uid = account_uid(plane, namespace, "cart")
    node = plane.core.read_node(NODE)
    replicas = [
        CaProcess(
            tmp_path / f"ca-{i}",
            *("--kubeconfig", str(account.kubeconfig), "--namespace", account.namespace),
            *("--instance-id", f"ca-{i}", "--pod-certificate-signer", REPLICA_SIGNER),
            *("--no-root-configmaps", "--no-istiod-tls"),
        )
        for i in range(2)
    ]
    try:
        for replica in replicas:
            replica.start()
        leader = leader_of(replicas)
        created = []
        for i in range(30):
            if i == 10:
                wait_for(lambda: len(audit_lines(leader)) >= 3, 20, "the leader to answer")
                leader.kill()
            pod = make_pod(plane, namespace, signer=REPLICA_SIGNER)
            body = pcr_body(pod, uid, node, REPLICA_SIGNER, generate_key("ECDSAP256"))
            created.append(create_pcr(kubelet, body))
        survivor = next(ca for ca in replicas if ca is not leader)
        answers = {
            f"{namespace}/{pcr['metadata']['name']}": wait_answered(
                plane.admin(), namespace, pcr["metadata"]["name"], 60
            )
            for pcr in created
        }
        assert Counter(outcome(done) for done in answers.values()) == {"Issued": 30}
        lines = [line for ca in replicas for line in audit_lines(ca)]
        assert {line["outcome"] for line in lines} == {"issued"}
        issued = Counter(line["request"] for line in lines)
        assert set(issued.values()) == {1}, issued
        for line in lines:
            leaf = chain_of(answers[line["request"]])[0]
            assert line["serial"] == format(leaf.serial_number, "x")
        unlogged = set(answers) - set(issued)
        assert len(unlogged) <= 1 and len(audit_lines(leader)) >= 3 and audit_lines(survivor)
        counted = survivor.metrics()
        assert sample_value(counted, "meshca_ca_pod_certificate_requests_total", CONFLICT) == 0
    finally:
        for replica in replicas:
            replica.stop()
        assert_calls_within_contract(plane, account, CA_RBAC | POD_CERTIFICATE_RBAC | granted)
        account.rbac.delete(plane)


def test_with_workers_one_process_signs_from_the_supervisors_pod_cache(
    plane: RealControlPlane,
    kubelet: kubernetes.client.ApiClient,
    tmp_path: Path,
) -> None:
    """`--workers 2`: the pods are cached once, in the supervisor (its socket carries the pods'
    podCertificate signers), and each worker is a replica under the Lease, so one watches the
    requests and signs."""
    account = make_account(plane, tmp_path / "account")
    granted = sign_for(plane, account, REPLICA_SIGNER)
    namespace = f"workers-{next(_names)}"
    plane.create_namespace(namespace)
    plane.create_service_account(namespace, "cart")
    uid = account_uid(plane, namespace, "cart")
    node = plane.core.read_node(NODE)
    ca = CaProcess(
        tmp_path / "ca",
        *("--kubeconfig", str(account.kubeconfig), "--namespace", account.namespace),
        *("--instance-id", "ca", "--pod-certificate-signer", REPLICA_SIGNER, "--workers", "2"),
        *("--no-root-configmaps", "--no-istiod-tls"),
    )
    try:
        ca.start(timeout=60)
        bare = make_pod(plane, namespace, signer=None)
        pods = [make_pod(plane, namespace, signer=REPLICA_SIGNER) for _ in range(10)]
        created = [
            create_pcr(kubelet, pcr_body(pod, uid, node, REPLICA_SIGNER, generate_key("ECDSAP256")))
            for pod in pods
        ]
        # Created by the admin (NodeRestriction would refuse it): the volume check is meshca's.
        _, refused = request(plane, plane.admin(), bare, "ECDSAP256", REPLICA_SIGNER)
        answers = [answered(plane, pcr) for pcr in created]
        assert Counter(outcome(done) for done in answers) == {"Issued": 10}
        cond = condition(answered(plane, refused))
        assert cond is not None and cond["reason"] == "NoPodCertificateVolume"
        lines = audit_lines(ca)
        assert len(lines) == 11 and len({line["pid"] for line in lines}) == 1
        # Only the worker holding the Lease listed and watched the requests.
        user = f"system:serviceaccount:{account.namespace}:{account.name}"
        agents = {
            event["userAgent"]
            for event in plane.audit_events(user)
            if (event.get("objectRef") or {}).get("resource") == "podcertificaterequests"
        }
        assert len(agents) == 1, agents
    finally:
        ca.stop()
        assert_calls_within_contract(plane, account, CA_RBAC | POD_CERTIFICATE_RBAC | granted)
        account.rbac.delete(plane)


ROTATION_SIGNER = "meshca.example.com/rotation"


def test_a_whole_rotation_keeps_every_pod_s_leaf_verifying_against_its_selected_bundles(
    plane: RealControlPlane,
    kubelet: kubernetes.client.ApiClient,
    tmp_path: Path,
) -> None:
    """Done means 2: pods holding kubelet-issued leaves through prepare → activate → taint →
    revoke, each pod trusting what its `clusterTrustBundle` projection selects (signer + the
    `meshca.io/trust` label, docs/trust-bundles.md), checked every ~50 ms by a watcher: every
    live leaf verifies against the selection at every moment and a revoked root is never in it.
    After the activation each pod's kubelet asks again (as it does at `beginRefreshAt`, which
    the signer sets before a planned handover) and gets a leaf of the new root; only then is
    the old root tainted and revoked."""
    account = make_account(plane, tmp_path / "account")
    granted = sign_for(plane, account, ROTATION_SIGNER)
    namespace = f"rotation-{next(_names)}"
    plane.create_namespace(namespace)
    plane.create_service_account(namespace, "cart")
    uid = account_uid(plane, namespace, "cart")
    node = plane.core.read_node(NODE)
    bundles: Any = kubernetes.client.CertificatesV1Api(plane.admin())
    ca = CaProcess(
        tmp_path / "ca",
        *("--kubeconfig", str(account.kubeconfig), "--namespace", account.namespace),
        *("--instance-id", "rotation", "--pod-certificate-signer", ROTATION_SIGNER),
        *("--no-root-configmaps", "--no-istiod-tls", "--ca-reload-interval", "300ms"),
    )
    pods = [make_pod(plane, namespace, signer=ROTATION_SIGNER) for _ in range(3)]

    def issued(pod: Any) -> list[x509.Certificate]:
        body = pcr_body(pod, uid, node, ROTATION_SIGNER, generate_key("ECDSAP256"))
        done = answered(plane, create_pcr(kubelet, body))
        assert outcome(done) == "Issued", condition(done)
        return chain_of(done)

    def issuer_id(chain: list[x509.Certificate]) -> str:
        extension = chain[0].extensions.get_extension_for_class(x509.AuthorityKeyIdentifier)
        return (extension.value.key_identifier or b"").hex()

    try:
        ca.start()
        target = cluster_target(account.kubeconfig, account.namespace)
        (first,) = authority_rows(target)
        old = first["id"]
        wait_for(lambda: selected_ids(bundles, ROTATION_SIGNER) == {old}, 10, "the root's bundle")
        with SelectionWatch(bundles, ROTATION_SIGNER) as watch:
            for i, pod in enumerate(pods):
                watch.add(f"pod-{i}/old", issued(pod))
            rows = authority_rows(target, "prepare")
            new = next(row["id"] for row in rows if row["state"] == "prepared")
            wait_for(
                lambda: selected_ids(bundles, ROTATION_SIGNER) == {old, new}, 10, "prepared root"
            )
            authority_rows(target, "activate", new)
            wait_for(lambda: issuer_id(issued(pods[0])) == new, 10, "leaves of the new root")
            for i, pod in enumerate(pods):  # each kubelet's refresh
                chain = issued(pod)
                assert issuer_id(chain) == new
                watch.add(f"pod-{i}/new", chain)
                watch.retire(f"pod-{i}/old")
            authority_rows(target, "taint", old)
            authority_rows(target, "revoke", old)
            wait_for(lambda: selected_ids(bundles, ROTATION_SIGNER) == {new}, 10, "old root gone")
            watch.mark_revoked(old)
            checks = watch.checks
            wait_for(lambda: watch.checks >= checks + 10, 10, "more checks after the revoke")
        assert not watch.problems, watch.problems[:5]
        assert watch.checks >= 20, watch.checks
        for pod in pods:  # and what pods ask for now verifies against what they select
            verify_chain(
                issued(pod), selected_roots(bundles, ROTATION_SIGNER), now=datetime.now(UTC)
            )
    finally:
        ca.stop()
        for bundle in bundles.list_cluster_trust_bundle(
            field_selector=f"spec.signerName={ROTATION_SIGNER}"
        ).items:
            bundles.delete_cluster_trust_bundle(bundle.metadata.name)
        assert_calls_within_contract(plane, account, CA_RBAC | POD_CERTIFICATE_RBAC | granted)
        account.rbac.delete(plane)
