"""A real istiod with its CA off serves xDS over TLS with the certificate meshca writes into
Secret istiod-tls (issue 33, Done means 3): Istio's pilot-agent, with CA_ADDR = meshca and its
discovery address = that istiod, gets its identity from meshca and its configuration from
istiod, verified against meshca's root; Envoy's config dump holds istiod's cluster for a Service
created in the API and the `default` secret meshca signed. Then a root rotation as
docs/istio-migration.md says (prepare, restart istiod, activate): istiod-tls and the agent both
move to the new authority, and every xDS disconnect Envoy sees is followed by a reconnect
within 5 s."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml
from cryptography import x509
from kubernetes.client.exceptions import ApiException

from ca_server.authority.slots import authority_id
from ca_server.kube.istiod_tls import SECRET_NAME as ISTIOD_TLS_SECRET
from ca_server.kube.root_publisher import CONFIGMAP_NAME
from certs import load_cert, load_certs
from tests.k8s_real.conftest import Account, RealCaFactory, unique
from tests.support.authority_cli import authority_rows, cluster_target
from tests.support.istio_agent import IstioAgent, IstiodAddress
from tests.support.istiod import Istiod, bootstrap_template, istio_crds
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane

RECONNECT_WITHIN = 5.0


def _apply_istio_crds(plane: RealControlPlane) -> None:
    api: Any = kubernetes.client.ApiextensionsV1Api(plane.admin())
    for doc in yaml.safe_load_all(istio_crds().read_text()):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        try:
            api.create_custom_resource_definition(doc)
        except ApiException as exc:
            if exc.status != 409:  # applied by an earlier test of this control plane
                raise


def _istiod_files(plane: RealControlPlane, namespace: str) -> tuple[dict[str, str], str] | None:
    """Secret istiod-tls's keys and the root ConfigMap's bundle, as the kubelet would mount
    them; None until both exist."""
    try:
        secret = plane.core.read_namespaced_secret(ISTIOD_TLS_SECRET, namespace)
        root = plane.core.read_namespaced_config_map(CONFIGMAP_NAME, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    tls = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
    return tls, (root.data or {})["root-cert.pem"]


def _signer(cert: x509.Certificate) -> str:
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier is not None
    return aki.key_identifier.hex()


def _ids(bundle: str) -> set[str]:
    return {authority_id(c) for c in load_certs(bundle.encode())}


class XdsConnection:
    """Polls Envoy's `control_plane.connected_state`; records how long each disconnect lasted."""

    def __init__(self, agent: IstioAgent) -> None:
        self._agent = agent
        self.outages: list[float] = []
        self._down_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                connected = self._agent.envoy.stat("control_plane.connected_state") == 1
            except OSError:
                connected = False
            now = time.monotonic()
            if not connected and self._down_since is None:
                self._down_since = now
            elif connected and self._down_since is not None:
                self.outages.append(now - self._down_since)
                self._down_since = None

    def __enter__(self) -> XdsConnection:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._down_since is not None:
            self.outages.append(float("inf"))  # still down at the end


def test_a_real_istiod_with_its_ca_off_serves_the_agent_and_follows_a_rotation(
    tmp_path: Path, control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    _apply_istio_crds(control_plane)
    namespace = ca_account.namespace  # istiod runs beside the CA, as in istio-system
    ca = real_ca("ca-0", "--ca-reload-interval", "500ms")
    wait_for(lambda: _istiod_files(control_plane, namespace) is not None, 15, "istiod-tls")
    files = _istiod_files(control_plane, namespace)
    assert files is not None
    istiod = Istiod(control_plane.admin_kubeconfig(tmp_path / "admin.kubeconfig"), namespace)
    istiod.mount(*files)

    app = unique("app")
    control_plane.create_namespace(app)
    control_plane.create_service_account(app, "cart")
    pod = control_plane.create_pod(app, "cart-1", "cart")
    control_plane.core.create_namespaced_service(
        app,
        kubernetes.client.V1Service(
            metadata=kubernetes.client.V1ObjectMeta(name="echo"),
            spec=kubernetes.client.V1ServiceSpec(
                selector={"app": "echo"},
                ports=[kubernetes.client.V1ServicePort(name="http", port=8080)],
            ),
        ),
    )
    token = control_plane.request_token(app, "cart", audiences=("istio-ca",), pod=pod)
    agent = IstioAgent(
        ca_addr=ca.addr,
        ca_root=ca.root_cert_path,
        namespace=app,
        service_account="cart",
        pod_name="cart-1",
        token=token,
        secret_ttl="10s",
        istiod=IstiodAddress(istiod.address, istiod.san, bootstrap_template()),
    )
    operator = control_plane.write_kubeconfig(
        tmp_path / "operator.kubeconfig",
        control_plane.request_token(namespace, ca_account.name, lifetime=3600),
    )
    target = cluster_target(operator, namespace)
    try:
        istiod.start()
        agent.start(timeout=60)
        outbound = f"outbound|8080||echo.{app}.svc.cluster.local"

        def dump() -> dict[str, Any]:
            return json.loads(agent.envoy.admin("/config_dump?include_eds"))

        def has_cluster() -> bool:
            return outbound in json.dumps(dump())

        wait_for(has_cluster, 30, f"istiod's cluster {outbound} in Envoy", 0.5)
        routes = [c for c in dump()["configs"] if c["@type"].endswith("RoutesConfigDump")]
        assert f"echo.{app}.svc.cluster.local:8080" in json.dumps(routes), "istiod's route"
        listeners = [c for c in dump()["configs"] if c["@type"].endswith("ListenersConfigDump")]
        assert "0.0.0.0_8080" in json.dumps(listeners), "istiod's outbound listener"
        secrets = [c for c in dump()["configs"] if c["@type"].endswith("SecretsConfigDump")]
        names = {s["name"] for c in secrets for s in c.get("dynamic_active_secrets", [])}
        assert {"default", "ROOTCA"} <= names, names
        (old,) = (row["id"] for row in authority_rows(target, "show"))

        def envoy_holds_meshcas_leaf() -> bool:
            leaf = load_cert(agent.output("cert-chain.pem"))
            return _signer(leaf) == old and leaf.serial_number in agent.envoy.cert_serials()

        # The `default` secret Envoy holds is the leaf meshca signed.
        wait_for(envoy_holds_meshcas_leaf, 10, "Envoy holding meshca's leaf", 0.2)
        assert "secure discovery service is disabled" not in istiod.log()

        with XdsConnection(agent) as connection:
            # prepare: istiod-tls's ca.crt and the root ConfigMap gain the new root; the kubelet
            # refreshes istiod's mounts; istiod is restarted (it reads its bundle only at start).
            prepared = next(
                r["id"] for r in authority_rows(target, "prepare") if r["state"] == "prepared"
            )

            def both_roots() -> bool:
                got = _istiod_files(control_plane, namespace)
                return (
                    got is not None
                    and _ids(got[0]["ca.crt"]) == {old, prepared}
                    and _ids(got[1]) == {old, prepared}
                )

            wait_for(both_roots, 15, "istiod-tls and the root ConfigMap with both roots", 0.2)
            files = _istiod_files(control_plane, namespace)
            assert files is not None
            istiod.mount(*files)
            istiod.restart()

            # activate: istiod-tls is re-issued from the new authority, the agent's leaf too.
            authority_rows(target, "activate", prepared)

            def istiod_on_new() -> bool:
                got = _istiod_files(control_plane, namespace)
                return (
                    got is not None and _signer(load_cert(got[0]["tls.crt"].encode())) == prepared
                )

            wait_for(istiod_on_new, 15, "istiod-tls from the activated authority", 0.2)
            files = _istiod_files(control_plane, namespace)
            assert files is not None
            istiod.mount(*files)
            wait_for(
                lambda: _signer(load_cert(agent.output("cert-chain.pem"))) == prepared,
                30,
                "the agent's leaf from the activated authority",
                0.2,
            )
            wait_for(has_cluster, 10, "istiod's config still in Envoy", 0.5)
        print(f"xDS outages seen by Envoy through the rotation: {connection.outages}")
        assert connection.outages, "istiod's restart must have been seen (a reconnect)"
        assert all(outage < RECONNECT_WITHIN for outage in connection.outages), connection.outages
    finally:
        agent.remove()
        istiod.stop()
