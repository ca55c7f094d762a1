"""The CA's roots as ClusterTrustBundles against the real kube-apiserver (issue 31): a client
selecting as the kubelet does for a pod's `clusterTrustBundle` projection (`signerName` +
`labelSelector: {matchLabels: {meshca.io/trust: "true"}}`, every match merged) gets exactly the
roots it must trust through a whole rotation driven by `meshca authority prepare / activate /
taint / revoke` — every live leaf the CA issued verifies against the selection at every moment,
and a revoked root leaves it and never comes back; edited, deleted or planted bundles are put
right; of two replicas only the Lease holder writes. And the API server's own refusal of a
bundle written without `attest` on its signer (Istio's, with --istio-cluster-trust-bundle).

The same rules against the fake API server, with the phases' labels: tests/k8s/
test_trust_bundles.py. Leaves come from CreateCertificate here; PodCertificateRequest-issued
ones come with the signer (docs/pod-certificates.md)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from cryptography import x509
from kubernetes.client.exceptions import ApiException

from ca_server.kube.trust_bundles import (
    ISTIO_BUNDLE_NAME,
    ISTIO_SIGNER,
    TRUST_LABEL,
    bundle_prefix,
)
from certs import load_certs
from tests.k8s_real.conftest import Account, RealCaFactory, make_account, unique
from tests.support.authority_cli import authority_rows, cluster_target
from tests.support.ca_process import CaProcess
from tests.support.kube_api_calls import ATTEST_REFUSAL, POD_CERTIFICATE_SIGNER
from tests.support.kube_mode import issue, spiffe
from tests.support.metrics import sample_value
from tests.support.pki import TestCa
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane
from tests.support.trust_selection import SelectionWatch, selected_ids

SIGNER = POD_CERTIFICATE_SIGNER  # the name deploy/'s RBAC lets the CA attest for
WITHIN = 10.0


def _api(plane: RealControlPlane) -> Any:
    return kubernetes.client.CertificatesV1Api(plane.admin())


def _selected_ids(api: Any) -> set[str]:
    return selected_ids(api, SIGNER)


def _signer_bundles(api: Any) -> list[Any]:
    return list(api.list_cluster_trust_bundle(field_selector=f"spec.signerName={SIGNER}").items)


def _clear(api: Any) -> None:
    for bundle in _signer_bundles(api):
        api.delete_cluster_trust_bundle(bundle.metadata.name)


def _leaf_chain(chain: list[str]) -> list[x509.Certificate]:
    """A CreateCertificate answer's chain without its root (the last element)."""
    return [cert for element in chain[:-1] for cert in load_certs(element.encode())]


def _writers(plane: RealControlPlane, account: Account) -> set[str]:
    username = f"system:serviceaccount:{account.namespace}:{account.name}"
    return {
        event["userAgent"].split(" ")[0]
        for event in plane.audit_events(username)
        if event["verb"] in ("create", "update", "patch", "delete")
        and (event.get("objectRef") or {}).get("resource") == "clustertrustbundles"
        and event.get("stage") == "ResponseComplete"
    }


def _leader(replicas: list[CaProcess]) -> CaProcess:
    leaders = [
        ca for ca in replicas if sample_value(ca.metrics(), "meshca_ca_root_publisher_leader") == 1
    ]
    assert len(leaders) == 1, "exactly one leader"
    return leaders[0]


@pytest.fixture
def bundles(control_plane: RealControlPlane) -> Iterator[Any]:
    """The admin's ClusterTrustBundle API, with none of the signer's before or after (they are
    cluster-wide: the next test of this control plane must not find them)."""
    api = _api(control_plane)
    _clear(api)
    try:
        yield api
    finally:
        _clear(api)


def test_the_selection_verifies_every_live_leaf_through_a_rotation(
    tmp_path: Path,
    control_plane: RealControlPlane,
    bundles: Any,  # first: cleared again only once the CAs (set up after it) have stopped
    ca_account: Account,
    real_ca: RealCaFactory,
):
    shop = unique("shop")
    control_plane.create_namespace(shop)
    control_plane.create_service_account(shop, "cart")
    pod = control_plane.create_pod(shop, "cart-1", "cart")
    token = control_plane.request_token(shop, "cart", audiences=("istio-ca",), pod=pod)
    identity = spiffe(shop, "cart")
    flags = ("--pod-certificate-signer", SIGNER, "--ca-reload-interval", "300ms")
    replicas = [real_ca(f"ca-{i}", *flags, start=False) for i in range(2)]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()
    target = cluster_target(ca_account.kubeconfig, ca_account.namespace)
    (first,) = authority_rows(target)
    old = first["id"]
    wait_for(lambda: _selected_ids(bundles) == {old}, WITHIN, "the active root's bundle", 0.1)

    with SelectionWatch(bundles, SIGNER) as watch:
        for i, ca in enumerate(replicas):
            watch.add(f"old-{i}", _leaf_chain(issue(ca, token, identity)))
        started = time.monotonic()
        rows = authority_rows(target, "prepare")
        new = next(r["id"] for r in rows if r["state"] == "prepared")
        # What the activation gate waits for: the prepared root reaches every pod first.
        wait_for(lambda: _selected_ids(bundles) == {old, new}, WITHIN, "the prepared root", 0.1)
        print(f"prepare → its bundle selected: {time.monotonic() - started:.2f}s")
        authority_rows(target, "activate", new)

        for i, ca in enumerate(replicas):
            wait_for(
                functools.partial(_signs_with, ca, token, identity, new),
                WITHIN,
                "signing with the new root",
                0.1,
            )
            watch.add(f"new-{i}", _leaf_chain(issue(ca, token, identity)))
        authority_rows(target, "taint", old)
        # The workloads holding leaves of the tainted root re-sign (as agents do), then it goes.
        for i, ca in enumerate(replicas):
            watch.add(f"resigned-{i}", _leaf_chain(issue(ca, token, identity)))
            watch.retire(f"old-{i}")
        started = time.monotonic()
        authority_rows(target, "revoke", old)
        wait_for(lambda: _selected_ids(bundles) == {new}, WITHIN, "the revoked root to go", 0.1)
        print(f"revoke → its bundle gone: {time.monotonic() - started:.2f}s")
        watch.mark_revoked(old)
        checks = watch.checks
        wait_for(lambda: watch.checks >= checks + 10, WITHIN, "more checks after the revoke")
    assert not watch.problems, watch.problems[:5]
    print(f"{watch.checks} checks of the selection through the rotation")

    # Put right: an edited bundle (label off), a deleted one, one planted under the signer.
    (own,) = _signer_bundles(bundles)
    own.metadata.labels = {"edited": "yes"}
    bundles.replace_cluster_trust_bundle(own.metadata.name, own)
    wait_for(lambda: _selected_ids(bundles) == {new}, WITHIN, "the edit undone", 0.1)
    bundles.delete_cluster_trust_bundle(own.metadata.name)
    wait_for(lambda: _selected_ids(bundles) == {new}, WITHIN, "the bundle re-created", 0.1)
    planted = bundle_prefix(SIGNER) + "planted"
    bundles.create_cluster_trust_bundle(
        kubernetes.client.V1ClusterTrustBundle(
            metadata=kubernetes.client.V1ObjectMeta(name=planted, labels={TRUST_LABEL: "true"}),
            spec=kubernetes.client.V1ClusterTrustBundleSpec(
                signer_name=SIGNER, trust_bundle=TestCa().root_pem
            ),
        )
    )
    wait_for(
        lambda: {b.metadata.name for b in _signer_bundles(bundles)} == {own.metadata.name},
        WITHIN,
        "the planted bundle deleted",
        0.1,
    )
    assert _selected_ids(bundles) == {new}

    # The Lease holder alone wrote them; both replicas see them in step.
    leader = _leader(replicas)
    assert _writers(control_plane, ca_account) == {f"meshca-ca/{leader.data_dir.name}"}
    wait_for(
        lambda: all(
            sample_value(ca.metrics(), "meshca_ca_trust_bundles_in_step") == 1 for ca in replicas
        ),
        WITHIN,
        "every replica to see the bundles in step",
    )


def _signs_with(ca: CaProcess, token: str, identity: str, authority: str) -> bool:
    """Whether `ca` signs a new leaf with `authority` (its Authority Key Identifier)."""
    leaf = load_certs(issue(ca, token, identity)[0].encode())[0]
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    return aki.key_identifier is not None and aki.key_identifier.hex() == authority


def test_istio_s_bundle_needs_attest_on_istio_s_signer(
    tmp_path: Path, control_plane: RealControlPlane
):
    """--istio-cluster-trust-bundle writes `istio.io:istiod-ca:root-cert` (signer
    `istio.io/istiod-ca`) with the whole bundle — once the account may `attest` for Istio's
    signer, which deploy/ does not grant (the flag is off there): until then the API server
    refuses the create in its own words, the CA says so and keeps trying."""
    account = make_account(control_plane, tmp_path / "account")
    api = _api(control_plane)
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(control_plane.admin())
    extra = f"istio-attest-{account.namespace}"
    ca = CaProcess(
        tmp_path / "ca",
        *("--kubeconfig", str(account.kubeconfig), "--namespace", account.namespace),
        *("--instance-id", "ca-0", "--istio-cluster-trust-bundle"),
    )
    try:
        ca.start()
        refusal = f'{ATTEST_REFUSAL} "{ISTIO_SIGNER}"'
        wait_for(lambda: refusal in ca.log(), WITHIN, "the API server's refusal in the log")
        with pytest.raises(ApiException) as missing:
            api.read_cluster_trust_bundle(ISTIO_BUNDLE_NAME)
        assert missing.value.status == 404
        rbac.create_cluster_role(
            {
                "metadata": {"name": extra},
                "rules": [
                    {
                        "apiGroups": ["certificates.k8s.io"],
                        "resources": ["signers"],
                        "resourceNames": [ISTIO_SIGNER],
                        "verbs": ["attest"],
                    }
                ],
            }
        )
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": extra},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": extra,
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": account.name, "namespace": account.namespace}
                ],
            }
        )

        def written() -> bool:
            try:
                bundle = api.read_cluster_trust_bundle(ISTIO_BUNDLE_NAME)
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
            return bool(
                bundle.spec.signer_name == ISTIO_SIGNER
                and bundle.spec.trust_bundle == ca.root_cert_path.read_text()
            )

        wait_for(written, 20, "Istio's bundle once attest is granted", 0.2)
    finally:
        ca.stop()
        for delete in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
            try:
                delete(extra)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        try:
            api.delete_cluster_trust_bundle(ISTIO_BUNDLE_NAME)
        except ApiException as exc:
            if exc.status != 404:
                raise
        account.rbac.delete(control_plane)
