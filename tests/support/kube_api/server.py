"""``KubeApiServer``: lifecycle plus the Python-side helpers tests use to arrange and inspect.

Runs the HTTP server on a background thread in the test process. Seeding helpers go straight to
the store (no HTTP, no request counting) but still emit watch events, so they behave like another
client changing the cluster.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from tests.support.process_marker import refuse_unless_marked

from .backend import Backend
from .faults import FaultPlan
from .handler import KubeApiHTTPServer
from .issuer import ServiceAccountIssuer
from .recorder import RequestRecord, RequestRecorder
from .resources import (
    CONFIGMAPS,
    NAMESPACES,
    PODS,
    SECRETS,
    SERVICEACCOUNTS,
    ResourceType,
    by_name,
)
from .store import DEFAULT_NAMESPACES, Store
from .tokens import DEFAULT_API_AUDIENCES, TokenAuthority, TokenInfo

if TYPE_CHECKING:
    import kubernetes.client


class KubeApiServer:
    """A fake kube-apiserver on ``127.0.0.1`` for tests.

    ``auth_token``: if set, API requests must carry ``Authorization: Bearer <auth_token>``.
    ``watch_timeout``: server-side cap on watches that give no ``timeoutSeconds`` (the real server
    closes them after 30-60 minutes; a short value here exercises client reconnects).
    ``history_limit``: events retained for watch resume; older resourceVersions get 410.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        auth_token: str | None = None,
        watch_timeout: float = 60.0,
        history_limit: int = 1000,
        require_namespaces: bool = True,
        namespaces: Iterable[str] = DEFAULT_NAMESPACES,
        api_audiences: Iterable[str] = DEFAULT_API_AUDIENCES,
    ) -> None:
        self.store = Store(history_limit=history_limit, require_namespaces=require_namespaces)
        self.store.seed_namespaces(tuple(namespaces))
        self.tokens = TokenAuthority(list(api_audiences))
        self.recorder = RequestRecorder()
        self.issuer = ServiceAccountIssuer()
        self.backend = Backend(
            store=self.store,
            tokens=self.tokens,
            recorder=self.recorder,
            issuer=self.issuer,
            auth_token=auth_token,
            watch_timeout=watch_timeout,
        )
        self._address = (host, port)
        self._httpd: KubeApiHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> KubeApiServer:
        if self._httpd is not None:
            raise RuntimeError("server already started")
        refuse_unless_marked("the fake Kubernetes API server")
        self.backend.stopping.clear()
        self._httpd = KubeApiHTTPServer(self._address, self.backend)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"kube-api-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, end watch streams and cut open connections. Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self.backend.stopping.set()
        self.store.close_watchers()
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def restart(self, downtime: float = 0.0) -> None:
        """Stop (cutting every watch and connection) and serve again on the same port with the
        same objects, as a restarted kube-apiserver behind a stable address would."""
        self._address = (self.host, self.port)
        self.stop()
        if downtime:
            time.sleep(downtime)
        self.start()

    @property
    def faults(self) -> FaultPlan:
        """Injected faults (`tests.support.kube_api.faults`)."""
        return self.backend.faults

    def __enter__(self) -> KubeApiServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return int(self._httpd.server_address[1])

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- client configuration ----------------------------------------------------------------

    def write_kubeconfig(
        self, path: str | os.PathLike[str], *, token: str | None = None, namespace: str = "default"
    ) -> Path:
        """Write a kubeconfig whose current context points at this server.

        ``token`` defaults to ``auth_token`` (or a dummy, which the server ignores).
        """
        user_token = token or self.backend.auth_token or "fake-kube-api-token"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-user", "user": {"token": user_token}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake-user", "namespace": namespace},
                }
            ],
            "current-context": "fake",
            "preferences": {},
        }
        out = Path(path)
        out.write_text(yaml.safe_dump(config, sort_keys=False))
        return out

    def client_configuration(self) -> kubernetes.client.Configuration:
        """A ``kubernetes.client.Configuration`` for this server (bearer token set if required)."""
        import kubernetes.client

        configuration = kubernetes.client.Configuration(host=self.url)
        if self.backend.auth_token:
            configuration.api_key = {"authorization": f"Bearer {self.backend.auth_token}"}
        return configuration

    def api_client(self) -> kubernetes.client.ApiClient:
        import kubernetes.client

        return kubernetes.client.ApiClient(self.client_configuration())

    # -- TokenReview -------------------------------------------------------------------------

    def add_token(
        self,
        token: str,
        username: str,
        *,
        uid: str = "",
        groups: Iterable[str] = (),
        extra: Mapping[str, Iterable[str]] | None = None,
        audiences: Iterable[str] | None = None,
        expires_at: float | None = None,
    ) -> TokenInfo:
        """Register a token with explicit user info (see ``TokenAuthority.add``)."""
        return self.tokens.add(
            token,
            username,
            uid=uid,
            groups=groups,
            extra=extra,
            audiences=audiences,
            expires_at=expires_at,
        )

    def add_service_account_token(
        self,
        token: str,
        namespace: str,
        service_account: str,
        *,
        audiences: Iterable[str] | None = None,
        pod_name: str | None = None,
        pod_uid: str | None = None,
        expires_at: float | None = None,
    ) -> TokenInfo:
        """Register a service-account token; bind it to a pod with ``pod_name``/``pod_uid``.

        If the pod exists in the store and ``pod_uid`` is omitted, its real uid is used; the
        user's uid is the stored ServiceAccount's, as the API server answers.
        """
        if pod_name is not None and pod_uid is None:
            pod = self.get("pods", pod_name, namespace=namespace, missing_ok=True)
            if pod is not None:
                pod_uid = pod["metadata"]["uid"]
        account_uid = self._account_uid(namespace, service_account)
        return self.tokens.add_service_account(
            token,
            namespace,
            service_account,
            audiences=audiences,
            pod_name=pod_name,
            pod_uid=pod_uid,
            sa_uid=account_uid,
            expires_at=expires_at,
        )

    def issue_service_account_token(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: Iterable[str] | None = None,
        pod_name: str | None = None,
        pod_uid: str | None = None,
        lifetime: float = 3600.0,
    ) -> str:
        """A signed projected token (a JWT from `issuer`), also known to TokenReview.

        As kubelet would: bound to ``pod_name`` (its stored uid unless ``pod_uid`` is given)
        and carrying the stored ServiceAccount's uid (empty when there is none).
        ``audiences=None`` means the API server audiences.
        """
        if pod_name is not None and pod_uid is None:
            pod = self.get("pods", pod_name, namespace=namespace, missing_ok=True)
            if pod is not None:
                pod_uid = pod["metadata"]["uid"]
        account_uid = self._account_uid(namespace, service_account)
        audience_list = list(audiences) if audiences is not None else self.tokens.api_audiences
        issued_at = time.time()
        token = self.issuer.sign(
            namespace,
            service_account,
            audiences=audience_list,
            pod_name=pod_name,
            pod_uid=pod_uid,
            service_account_uid=account_uid or "",
            lifetime=lifetime,
            issued_at=issued_at,
        )
        self.tokens.add_service_account(
            token,
            namespace,
            service_account,
            audiences=audience_list,
            pod_name=pod_name,
            pod_uid=pod_uid,
            sa_uid=account_uid,
            expires_at=issued_at + lifetime,
        )
        return token

    def remove_token(self, token: str) -> None:
        self.tokens.remove(token)

    @property
    def tokenreview_count(self) -> int:
        return self.recorder.count("create", "tokenreviews")

    # -- request counters --------------------------------------------------------------------

    def count(self, verb: str | None = None, resource: str | None = None) -> int:
        """Requests seen for (verb, resource), e.g. ``count("watch", "pods")``."""
        return self.recorder.count(verb, resource)

    def request_counts(self) -> dict[tuple[str, str], int]:
        return self.recorder.counts()

    def requests(self) -> list[RequestRecord]:
        return self.recorder.records()

    def delay_lists(self, seconds: float) -> None:
        """Make every later list wait `seconds` before answering (0 turns it off)."""
        self.backend.list_delay = seconds

    def reset_counts(self) -> None:
        self.recorder.reset()

    # -- direct store access (seeding / inspection) ------------------------------------------

    @property
    def resource_version(self) -> int:
        return self.store.resource_version

    def compact(self) -> None:
        """Drop watch history: resuming from any earlier resourceVersion now gives 410."""
        self.store.compact()

    def create(
        self, resource: str | ResourceType, obj: Mapping[str, Any], *, namespace: str | None = None
    ) -> dict[str, Any]:
        """Create an object without HTTP. A supplied ``metadata.uid`` and ``status`` are kept."""
        rt = by_name(resource)
        ns = namespace or (obj.get("metadata") or {}).get("namespace")
        return self.store.create(rt, ns, dict(obj), trusted=True)

    def get(
        self,
        resource: str | ResourceType,
        name: str,
        *,
        namespace: str | None = None,
        missing_ok: bool = False,
    ) -> Any:
        """The stored object, or ``None`` with ``missing_ok`` (else ``ApiError`` 404)."""
        from .errors import ApiError

        try:
            return self.store.get(by_name(resource), namespace, name)
        except ApiError:
            if missing_ok:
                return None
            raise

    def list(
        self, resource: str | ResourceType, *, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        items, _ = self.store.list(by_name(resource), namespace)
        return items

    def update(self, resource: str | ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Replace an object (status included); honours a resourceVersion precondition."""
        meta = obj.get("metadata") or {}
        return self.store.update(by_name(resource), meta.get("namespace"), meta["name"], dict(obj))

    def patch(
        self,
        resource: str | ResourceType,
        name: str,
        patch: Mapping[str, Any],
        *,
        namespace: str | None = None,
    ) -> dict[str, Any]:
        """JSON-merge-patch an object (status included)."""
        return self.store.patch(
            by_name(resource), namespace, name, "application/merge-patch+json", dict(patch)
        )

    def delete(
        self, resource: str | ResourceType, name: str, *, namespace: str | None = None
    ) -> dict[str, Any]:
        return self.store.delete(by_name(resource), namespace, name)

    def create_namespace(
        self, name: str, *, labels: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        return self.create(NAMESPACES, {"metadata": {"name": name, "labels": dict(labels or {})}})

    def create_pod(
        self,
        namespace: str,
        name: str,
        *,
        service_account: str = "default",
        uid: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        node_name: str | None = None,
        phase: str = "Running",
        pod_ip: str | None = None,
    ) -> dict[str, Any]:
        """Seed a minimal but valid-looking Pod (one container), and its ServiceAccount if the
        namespace has none of that name yet (a real API server refuses a pod whose account
        does not exist, so a seeded pod's account exists too)."""
        self.ensure_service_account(namespace, service_account)
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            metadata["uid"] = uid
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        spec: dict[str, Any] = {
            "serviceAccountName": service_account,
            "containers": [{"name": "app", "image": "example.invalid/app:latest"}],
        }
        if node_name:
            spec["nodeName"] = node_name
        status: dict[str, Any] = {"phase": phase}
        if pod_ip:
            status["podIP"] = pod_ip
            status["podIPs"] = [{"ip": pod_ip}]
        return self.create(PODS, {"metadata": metadata, "spec": spec, "status": status})

    def create_service_account(
        self, namespace: str, name: str, *, uid: str | None = None
    ) -> dict[str, Any]:
        """Seed a ServiceAccount (a fresh uid unless `uid` is given)."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            metadata["uid"] = uid
        return self.create(SERVICEACCOUNTS, {"metadata": metadata})

    def _account_uid(self, namespace: str, name: str) -> str | None:
        account = self.get(SERVICEACCOUNTS, name, namespace=namespace, missing_ok=True)
        return str(account["metadata"]["uid"]) if account is not None else None

    def ensure_service_account(self, namespace: str, name: str) -> dict[str, Any]:
        """The ServiceAccount `namespace/name`, seeded first if it does not exist."""
        existing = self.get(SERVICEACCOUNTS, name, namespace=namespace, missing_ok=True)
        if existing is not None:
            return dict(existing)
        return self.create_service_account(namespace, name)

    def create_secret(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, bytes | str] | None = None,
        *,
        type: str = "Opaque",
        labels: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Seed a Secret; ``data`` values are raw (encoded to base64 here)."""
        encoded = {
            key: base64.b64encode(value.encode() if isinstance(value, str) else value).decode()
            for key, value in (data or {}).items()
        }
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if labels:
            metadata["labels"] = dict(labels)
        return self.create(SECRETS, {"metadata": metadata, "type": type, "data": encoded})

    def create_configmap(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str] | None = None,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if labels:
            metadata["labels"] = dict(labels)
        return self.create(CONFIGMAPS, {"metadata": metadata, "data": dict(data or {})})
