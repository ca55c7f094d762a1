"""A real Kubernetes control plane on loopback: etcd and kube-apiserver, built from pinned Go
modules (`tests.support.real_binaries`), with RBAC on and a service-account issuer.

Why real: the fake API server (`tests.support.kube_api`) answers the way its author believed the
server answers; it enforces no RBAC and signs tokens its own way. This one is the server: RBAC
decides, TokenRequest signs bound tokens, TokenReview checks pods and ServiceAccounts, and
`/openid/v1/jwks` serves the issuer's key. No kubelet, scheduler or controller-manager runs:
pods are created with `spec.nodeName` set and stay Pending, which is all meshca reads of them;
nothing here deletes namespaces (that needs the namespace controller).

Started once per test session (per xdist worker) by the fixture in tests/k8s_real/conftest.py;
tests isolate themselves by namespace. The admin (group system:masters, client certificate)
seeds objects; meshca's components authenticate as their ServiceAccounts, with exactly the RBAC
from `deploy/` (`tests.support.real_kube.rbac`).
"""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jwt
import kubernetes.client
import yaml
from kubernetes.client.exceptions import ApiException

from tests.support.processes import free_port, stop_child, wait_for
from tests.support.real_binaries import binary

from .pki import ClusterFiles, issue_client_certificate, write_cluster_pki

ISSUER = "https://kubernetes.default.svc.cluster.local"
# Every request a ServiceAccount makes, at Metadata level (verb, resource, user agent, status):
# what the tests check meshca's API calls against (tests/support/kube_api_calls.py), on the
# real server.
_AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}
_START_TIMEOUT = 90.0


class ControlPlaneError(RuntimeError):
    """etcd or kube-apiserver did not start; the message carries the end of its log."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class RealControlPlane:
    """`start()` → etcd and kube-apiserver running; `stop()` ends both and removes their files."""

    def __init__(self, *, node_authorization: bool = False) -> None:
        # The Node authorizer and the NodeRestriction admission plugin, as a production cluster
        # runs them (kubelets as `system:node:<name>`, `client_as`): for the Pod Certificate
        # tests only, so the other suites keep the plane they were written against.
        self.node_authorization = node_authorization
        # Short: etcd's and the API server's Unix sockets must fit in 107 bytes.
        self.directory = Path(tempfile.mkdtemp(prefix="mk-", dir="/tmp"))
        self.files: ClusterFiles = write_cluster_pki(self.directory / "pki")
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.port = free_port()
        self._procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self._admin: kubernetes.client.ApiClient | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> RealControlPlane:
        try:
            self._start_etcd()
            self._start_apiserver()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        for _, proc, _ in reversed(self._procs):
            stop_child(proc, timeout=15)
        self._procs.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log_path = self.directory / f"{name}.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [str(binary(name)), *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.directory
            )
        self._procs.append((name, proc, log_path))
        return proc

    def _wait(self, name: str, proc: subprocess.Popen[bytes], ready: Any) -> None:
        log_path = self.directory / f"{name}.log"

        def up() -> bool:
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                return bool(ready())
            except OSError:
                return False

        try:
            wait_for(up, _START_TIMEOUT, f"{name} to be ready", interval=0.2)
        except TimeoutError:
            raise ControlPlaneError(
                f"{name} not ready in {_START_TIMEOUT:.0f}s:\n{_tail(log_path)}"
            ) from None

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        proc = self._spawn(
            "etcd",
            [
                "--name=meshca-test",
                f"--data-dir={self.directory / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=meshca-test={peer}",
                "--unsafe-no-fsync",  # a test's data need not survive a power cut
                "--log-level=warn",
            ],
        )

        def healthy() -> bool:
            with urllib.request.urlopen(f"{client}/health", timeout=2) as response:
                return b'"true"' in response.read()

        self._wait("etcd", proc, healthy)

    def _start_apiserver(self) -> None:
        f = self.files
        policy = self.directory / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(_AUDIT_POLICY))
        proc = self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",  # no Endpoints for a loopback address
                f"--secure-port={self.port}",
                f"--cert-dir={self.directory / 'certs'}",
                f"--tls-cert-file={f.serving_cert}",
                f"--tls-private-key-file={f.serving_key}",
                f"--client-ca-file={f.ca_cert}",
                f"--service-account-issuer={ISSUER}",
                f"--service-account-key-file={f.sa_public_key}",
                f"--service-account-signing-key-file={f.sa_signing_key}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=Node,RBAC"
                if self.node_authorization
                else "--authorization-mode=RBAC",
                *(
                    ["--enable-admission-plugins=NodeRestriction"]
                    if self.node_authorization
                    else []
                ),
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_path}",
                "--audit-log-mode=blocking",
                "--profiling=false",
                "--v=1",
            ],
        )
        context = self.ssl_context()

        def ready() -> bool:
            request = urllib.request.Request(f"{self.url}/readyz")
            with urllib.request.urlopen(request, timeout=3, context=context) as response:
                return response.status == 200

        self._wait("kube-apiserver", proc, ready)

    @property
    def audit_path(self) -> Path:
        return self.directory / "audit.log"

    def audit_events(self, username: str | None = None) -> list[dict[str, Any]]:
        """The audit log's events (of `username`, e.g. system:serviceaccount:ns:meshca)."""
        events = []
        with self.audit_path.open(encoding="utf-8") as stream:
            for line in stream:
                event = json.loads(line)
                if username is None or event.get("user", {}).get("username") == username:
                    events.append(event)
        return events

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")

    # -- clients ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.files.ca_cert))
        context.load_cert_chain(str(self.files.admin_cert), str(self.files.admin_key))
        return context

    def admin(self) -> kubernetes.client.ApiClient:
        """A client authenticated as a cluster admin (group system:masters)."""
        if self._admin is None:
            configuration = kubernetes.client.Configuration(host=self.url)
            configuration.ssl_ca_cert = str(self.files.ca_cert)
            configuration.cert_file = str(self.files.admin_cert)
            configuration.key_file = str(self.files.admin_key)
            self._admin = kubernetes.client.ApiClient(configuration)
        return self._admin

    def client_as(self, common_name: str, organization: str | None = None) -> Any:
        """An `ApiClient` authenticated by a client certificate as user `common_name` in group
        `organization` (a kubelet: `system:node:<node>`, `system:nodes`). Close it after use."""
        cert, key = issue_client_certificate(
            self.files, self.directory / "clients", common_name, organization
        )
        configuration = kubernetes.client.Configuration(host=self.url)
        configuration.ssl_ca_cert = str(self.files.ca_cert)
        configuration.cert_file = str(cert)
        configuration.key_file = str(key)
        return kubernetes.client.ApiClient(configuration)

    @property
    def core(self) -> Any:
        """CoreV1Api as the admin (typed Any: tests read its optional fields freely)."""
        return kubernetes.client.CoreV1Api(self.admin())

    def write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        """A kubeconfig that authenticates with `token` (a ServiceAccount's, see
        `account_token`)."""
        ca_data = base64.b64encode(self.files.ca_cert.read_bytes()).decode()
        cluster = {"server": self.url, "certificate-authority-data": ca_data}
        context = {"cluster": "real", "user": "account", "namespace": namespace}
        return _write_kubeconfig(path, cluster, ("account", {"token": token}), context)

    def admin_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for the cluster admin (its client certificate): for tools like helm."""
        cluster = {"server": self.url, "certificate-authority": str(self.files.ca_cert)}
        user = {
            "client-certificate": str(self.files.admin_cert),
            "client-key": str(self.files.admin_key),
        }
        return _write_kubeconfig(
            path, cluster, ("admin", user), {"cluster": "real", "user": "admin"}
        )

    def account_kubeconfig(self, path: Path, namespace: str, service_account: str) -> Path:
        """A kubeconfig for `namespace/service_account` (a 24 h token from TokenRequest)."""
        token = self.request_token(namespace, service_account, lifetime=86400)
        return self.write_kubeconfig(path, token, namespace)

    # -- objects ---------------------------------------------------------------------------

    def create_namespace(self, name: str) -> Any:
        body = kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
        return self.core.create_namespace(body)

    def create_service_account(self, namespace: str, name: str) -> Any:
        body = kubernetes.client.V1ServiceAccount(
            metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=namespace)
        )
        return self.core.create_namespaced_service_account(namespace, body)

    def delete_service_account(self, namespace: str, name: str) -> None:
        self.core.delete_namespaced_service_account(name, namespace)

    def ensure_node(self, name: str) -> Any:
        """A Node object (no kubelet behind it): TokenRequest records the node of a bound
        pod, and TokenReview checks it still exists."""
        try:
            return self.core.read_node(name)
        except ApiException as exc:
            if exc.status != 404:
                raise
        body = kubernetes.client.V1Node(metadata=kubernetes.client.V1ObjectMeta(name=name))
        return self.core.create_node(body)

    def create_pod(
        self,
        namespace: str,
        name: str,
        service_account: str,
        node_name: str = "node-a",
        *,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> Any:
        """A pod already bound to `node_name` (no scheduler needed); it stays Pending."""
        self.ensure_node(node_name)
        body = kubernetes.client.V1Pod(
            metadata=kubernetes.client.V1ObjectMeta(
                name=name,
                namespace=namespace,
                labels=dict(labels or {}),
                annotations=dict(annotations or {}),
            ),
            spec=kubernetes.client.V1PodSpec(
                service_account_name=service_account,
                node_name=node_name,
                containers=[
                    kubernetes.client.V1Container(name="app", image="example.invalid/app:1")
                ],
            ),
        )
        return self.core.create_namespaced_pod(namespace, body)

    def delete_pod(self, namespace: str, name: str) -> None:
        """Deleted at once (grace 0): no kubelet would ever confirm a graceful stop."""
        self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        wait_for(lambda: not self._pod_exists(namespace, name), 10, f"pod {name} gone")

    def _pod_exists(self, namespace: str, name: str) -> bool:
        try:
            self.core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # -- tokens ----------------------------------------------------------------------------

    def request_token(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: Iterable[str] = (ISSUER,),
        pod: Any | None = None,
        lifetime: int = 3600,
    ) -> str:
        """A token from the TokenRequest API, bound to `pod` (a V1Pod) when given, as kubelet
        asks for a projected token."""
        bound = None
        if pod is not None:
            bound = kubernetes.client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid
            )
        body = kubernetes.client.AuthenticationV1TokenRequest(
            spec=kubernetes.client.V1TokenRequestSpec(
                audiences=list(audiences), expiration_seconds=lifetime, bound_object_ref=bound
            )
        )
        answer: Any = self.core.create_namespaced_service_account_token(
            service_account, namespace, body
        )
        return str(answer.status.token)

    def token_review(self, token: str, audiences: Iterable[str]) -> Any:
        """The API server's own verdict on `token` (a TokenReview as the admin)."""
        body = kubernetes.client.V1TokenReview(
            spec=kubernetes.client.V1TokenReviewSpec(token=token, audiences=list(audiences))
        )
        api: Any = kubernetes.client.AuthenticationV1Api(self.admin())
        return api.create_token_review(body).status

    def resign(self, token: str, changes: Mapping[str, Any], key_pem: bytes | None = None) -> str:
        """`token`'s claims with `changes` applied, signed again with the issuer's key (or
        `key_pem`), under the same key id: what a token the server issued at another time, or
        with other claims, looks like — the TokenRequest API cannot back-date a token."""
        header = jwt.get_unverified_header(token)
        claims = {**jwt.decode(token, options={"verify_signature": False}), **changes}
        claims = {k: v for k, v in claims.items() if v is not None}
        key = key_pem if key_pem is not None else self.files.sa_signing_key.read_bytes()
        return jwt.encode(claims, key, algorithm=header["alg"], headers={"kid": header["kid"]})

    @staticmethod
    def now() -> int:
        return int(time.time())


def _write_kubeconfig(
    path: Path, cluster: dict[str, str], user: tuple[str, dict[str, str]], context: dict[str, str]
) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "real", "cluster": cluster}],
        "users": [{"name": user[0], "user": user[1]}],
        "contexts": [{"name": "real", "context": context}],
        "current-context": "real",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
