"""A fleet on a real API server, created as fast as the server takes it: namespaces, nodes,
service accounts and pods (for `bench/fleet_scale.py`).

Why raw HTTP: the kubernetes client builds and parses a model object per call (~0.5 ms of CPU
per pod on the client side alone); at 60,000 pods the bench would measure itself. Here each
thread of a pool keeps one keep-alive TLS connection as the cluster admin and POSTs a small
JSON body; answers are not parsed except where a value is needed (a token).

The fleet is a pure function of its shape: pod `i` lives in namespace `i % namespaces`, runs
account `(i // namespaces) % accounts` and is bound to node `i % nodes`, so a run grows from
one pod count to the next by creating only the missing indices, and any pod's identity can be
recomputed (for its token and CSR) without listing. No scheduler or kubelet runs: pods keep
`spec.nodeName` and stay Pending, which is all the CA reads of them. The ServiceAccount
admission plugin refuses a pod whose account does not exist, so accounts come first; Nodes
exist because TokenRequest records the bound pod's node.

Concurrency: `FleetClient` is used from the pool's threads, one `http.client` connection per
thread (`threading.local`); nothing else is shared.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tests.support.real_kube import RealControlPlane

AUDIENCE = "istio-ca"
_RETRY_STATUSES = {429, 500, 503, 504}
_ATTEMPTS = 8


class FleetError(RuntimeError):
    """The API server refused a request the fleet needs (status and answer in the message)."""


@dataclass(frozen=True)
class FleetShape:
    namespaces: int = 200
    nodes: int = 500
    accounts_per_namespace: int = 50

    def namespace(self, index: int) -> str:
        return f"fleet-{index:04d}"

    def node(self, index: int) -> str:
        return f"fleet-node-{index:04d}"

    def account(self, index: int) -> str:
        return f"sa-{index:03d}"

    def pod(self, index: int) -> tuple[str, str, str, str]:
        """(namespace, pod name, service account, node) of pod number `index`."""
        return (
            self.namespace(index % self.namespaces),
            f"pod-{index:07d}",
            self.account((index // self.namespaces) % self.accounts_per_namespace),
            self.node(index % self.nodes),
        )


@dataclass(frozen=True)
class Created:
    """What one `create_*` call did: objects and seconds (its rate is what the server took)."""

    kind: str
    count: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        return f"{self.count:,} {self.kind} in {self.seconds:.1f} s ({self.rate:,.0f}/s)"


class FleetClient:
    """Admin requests to the control plane over per-thread keep-alive connections."""

    def __init__(self, plane: RealControlPlane, threads: int = 16) -> None:
        url = urlsplit(plane.url)
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 443
        self._context = plane.ssl_context()
        self._local = threading.local()
        self.threads = threads

    def _connection(self) -> http.client.HTTPSConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPSConnection(
                self._host, self._port, context=self._context, timeout=60
            )
            self._local.connection = connection
        return connection

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        accept: Iterable[int] = (200, 201),
    ) -> tuple[int, bytes]:
        """One request, retried on throttling and connection loss; a status outside `accept`
        raises `FleetError`."""
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        accepted = set(accept)
        for attempt in range(_ATTEMPTS):
            connection = self._connection()
            try:
                connection.request(method, path, body=payload, headers=headers)
                response = connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                time.sleep(0.1 * 2**attempt)
                continue
            if response.status in accepted:
                return response.status, data
            if response.status in _RETRY_STATUSES:
                time.sleep(0.1 * 2**attempt)
                continue
            raise FleetError(f"{method} {path}: {response.status} {data[:300]!r}")
        raise FleetError(f"{method} {path}: no answer after {_ATTEMPTS} attempts")

    def create(self, path: str, body: dict[str, Any]) -> None:
        """POST; an object that already exists (409) counts as created: a grown fleet keeps
        what the previous size made."""
        self.request("POST", path, body, accept=(200, 201, 202, 409))

    def each(self, items: Sequence[Any], call: Callable[[Any], Any]) -> list[Any]:
        """`call(item)` for every item on the pool, results in order."""
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(call, items, chunksize=64))


def _namespace_body(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def _node_body(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def _account_body(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}


def _pod_body(name: str, account: str, node: str) -> dict[str, Any]:
    """The pod `RealControlPlane.create_pod` makes: one container, bound to its node."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": account}},
        "spec": {
            "serviceAccountName": account,
            "nodeName": node,
            "containers": [{"name": "app", "image": "example.invalid/app:1"}],
        },
    }


class Fleet:
    """The fleet of `shape` on `plane`; `grow_to(n)` creates what is missing for `n` pods."""

    def __init__(self, plane: RealControlPlane, shape: FleetShape, threads: int = 16) -> None:
        self.shape = shape
        self.client = FleetClient(plane, threads)
        self.pods = 0
        self._scaffolded = False

    def _timed(self, kind: str, items: Sequence[Any], call: Callable[[Any], Any]) -> Created:
        started = time.perf_counter()
        self.client.each(items, call)
        return Created(kind, len(items), time.perf_counter() - started)

    def scaffold(self) -> list[Created]:
        """Namespaces, nodes and service accounts (once)."""
        if self._scaffolded:
            return []
        shape, client = self.shape, self.client
        namespaces = [shape.namespace(i) for i in range(shape.namespaces)]
        done = [
            self._timed(
                "namespaces",
                namespaces,
                lambda ns: client.create("/api/v1/namespaces", _namespace_body(ns)),
            ),
            self._timed(
                "nodes",
                [shape.node(i) for i in range(shape.nodes)],
                lambda node: client.create("/api/v1/nodes", _node_body(node)),
            ),
        ]
        accounts = [
            (ns, shape.account(a)) for ns in namespaces for a in range(shape.accounts_per_namespace)
        ]
        done.append(
            self._timed(
                "service accounts",
                accounts,
                lambda pair: client.create(
                    f"/api/v1/namespaces/{pair[0]}/serviceaccounts", _account_body(pair[1])
                ),
            )
        )
        self._scaffolded = True
        return done

    def grow_to(self, pods: int) -> Created:
        """Creates pods `self.pods .. pods-1`."""
        client, shape = self.client, self.shape

        def create(index: int) -> None:
            namespace, name, account, node = shape.pod(index)
            client.create(f"/api/v1/namespaces/{namespace}/pods", _pod_body(name, account, node))

        created = self._timed("pods", range(self.pods, pods), create)
        self.pods = max(self.pods, pods)
        return created

    def spread(self, count: int) -> list[int]:
        """`count` distinct pod indices spread evenly over the fleet (fewer if it is smaller)."""
        count = min(count, self.pods)
        if count == 0:
            return []
        step = self.pods / count
        return sorted({int(i * step) for i in range(count)})

    def label(self, indices: Sequence[int], value: str) -> Created:
        """A label patch on each pod: one MODIFIED watch event per pod for every watcher."""
        client, shape = self.client, self.shape
        patch = {"metadata": {"labels": {"fleet-bench-round": value}}}

        def change(index: int) -> None:
            namespace, name, _, _ = shape.pod(index)
            client.request(
                "PATCH",
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                patch,
                content_type="application/merge-patch+json",
            )

        return self._timed("pod label patches", indices, change)

    def tokens(self, indices: Sequence[int], lifetime: int = 3600) -> list[str]:
        """A pod-bound token (TokenRequest, audience istio-ca, `boundObjectRef` kind Pod) for
        each pod, as kubelet asks for a projected token; the server fills in the pod's uid."""
        client, shape = self.client, self.shape

        def token(index: int) -> str:
            namespace, name, account, _ = shape.pod(index)
            body = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [AUDIENCE],
                    "expirationSeconds": lifetime,
                    "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": name},
                },
            }
            _, data = client.request(
                "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", body
            )
            return str(json.loads(data)["status"]["token"])

        return client.each(indices, token)
