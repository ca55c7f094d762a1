"""Publishes the mesh root as ConfigMap `istio-ca-root-cert` in every namespace.

The object's shape: docs/reference.md#root-configmap.

Level-triggered reconciliation: two watches (namespaces; the ConfigMaps of that name in all
namespaces) keep a picture of the cluster, and whenever either changes, the root changes, or
leadership is gained, one reconcile pass compares every namespace's ConfigMap with the wanted
one and creates or updates what differs. So a new namespace gets its copy, a deleted or edited
copy is restored, and a new root reaches all namespaces, each within one watch round-trip. A
periodic pass (`resync_interval`) repairs anything a lost event might have left behind.

Only the Lease holder writes (`is_leader`); every replica watches, so a new leader starts from
a warm cache. Updates carry the resourceVersion read, so a write racing another writer fails
with 409 and the next pass re-reads. Keys other than `root-cert.pem` and `meshca-taints.json`
and labels others added are kept.

Beside the bundle, key `meshca-taints.json` carries the taint notice (`meshca.taint_notice`:
which authorities are tainted, and since when), set together with the root (`set_root`) and
written in the same update, so a kubelet's mount of the ConfigMap shows an agent both files at
once (`agent.taint_file` reads the notice beside `root-cert.pem`). A notice of `None` (not
known) leaves whatever the key holds.

Concurrency: the reconciler runs in its own daemon thread, woken through a `threading.Event`
by the watch threads (`Informer.on_change`), the election thread and the event loop
(`set_root`). All its API calls block only that thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import kubernetes.client

from ca_server.kube.reconcile_loop import ReconcileThread, guarded_write
from ca_server.metrics import CaMetrics
from meshca.informer import Informer
from meshca.taint_notice import TAINT_NOTICE_NAME

log = logging.getLogger(__name__)

CONFIGMAP_NAME = "istio-ca-root-cert"
ROOT_KEY = "root-cert.pem"
TAINTS_KEY = TAINT_NOTICE_NAME
LABELS = {"istio.io/config": "true"}
SKIPPED_NAMESPACES = frozenset({"kube-public", "kube-node-lease"})
_REQUEST_TIMEOUT = (2.0, 5.0)


@dataclass(frozen=True)
class NamespaceInfo:
    name: str
    terminating: bool


@dataclass(frozen=True)
class ConfigMapInfo:
    namespace: str
    resource_version: str
    labels: dict[str, str]
    annotations: dict[str, str]
    data: dict[str, str]


def _namespace_info(obj: Any) -> NamespaceInfo:
    phase = obj.status.phase if obj.status else None
    return NamespaceInfo(obj.metadata.name, phase == "Terminating")


def _configmap_info(obj: Any) -> ConfigMapInfo:
    meta = obj.metadata
    return ConfigMapInfo(
        meta.namespace,
        meta.resource_version,
        dict(meta.labels or {}),
        dict(meta.annotations or {}),
        dict(obj.data or {}),
    )


@dataclass(frozen=True)
class Published:
    """What every namespace's ConfigMap should hold: the bundle, and the taint notice (None:
    leave the key as it is)."""

    root_pem: str
    taint_notice: str | None = None

    def data(self, current: dict[str, str]) -> dict[str, str]:
        """`current` with the keys this publisher owns set (others kept)."""
        data = {**current, ROOT_KEY: self.root_pem}
        if self.taint_notice is not None:
            data[TAINTS_KEY] = self.taint_notice
        return data


def needs_update(existing: ConfigMapInfo, wanted: Published) -> bool:
    labelled = all(existing.labels.get(k) == v for k, v in LABELS.items())
    return existing.data != wanted.data(existing.data) or not labelled


class RootConfigMapPublisher:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        is_leader: Callable[[], bool],
        metrics: CaMetrics,
        *,
        resync_interval: timedelta = timedelta(seconds=60),
    ) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self._is_leader = is_leader
        self._metrics = metrics
        self._resync = resync_interval.total_seconds()
        self._wanted: Published | None = None  # replaced whole, so a pass reads one version
        # `self.reconcile()` looked up at each pass, not bound now (a test patches it).
        self._loop = ReconcileThread(
            "root-publisher", lambda: self._resync, lambda: self.reconcile(), log
        )
        restarts = metrics.kube_watch_restarts
        self.namespaces: Informer[NamespaceInfo] = Informer(
            "namespaces",
            self._core.list_namespace,
            _namespace_info,
            on_change=self.kick,
            on_restart=lambda cause: restarts.labels("namespaces", cause).inc(),
        )
        self.configmaps: Informer[ConfigMapInfo] = Informer(
            "configmaps",
            self._core.list_config_map_for_all_namespaces,
            _configmap_info,
            list_kwargs={"field_selector": f"metadata.name={CONFIGMAP_NAME}"},
            on_change=self.kick,
            on_restart=lambda cause: restarts.labels("configmaps", cause).inc(),
        )

    # -- called from other threads ---------------------------------------------------------

    def set_root(self, root_pem: str, taint_notice: str | None = None) -> None:
        """The bundle and the taint notice to publish, both at once (one update each)."""
        self._wanted = Published(root_pem, taint_notice)
        self.kick()

    def kick(self) -> None:
        self._loop.kick()

    def start(self) -> None:
        self.namespaces.start()
        self.configmaps.start()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        self.namespaces.stop()
        self.configmaps.stop()

    # -- the reconciler thread -------------------------------------------------------------

    def reconcile(self) -> bool:
        """One pass; False if a write failed and the pass should be retried soon."""
        wanted = self._wanted
        if wanted is None or not self._is_leader():
            return True
        if not (self.namespaces.synced and self.configmaps.synced):
            return True  # the sync itself will kick us
        ok = True
        existing = self.configmaps.items()
        for namespace in sorted(self.namespaces.items().values(), key=lambda n: n.name):
            if namespace.name in SKIPPED_NAMESPACES or namespace.terminating:
                continue
            if not self._is_leader() or self._loop.stopping:
                return True
            current = existing.get((namespace.name, CONFIGMAP_NAME))
            if current is None:
                ok &= self._write("create", namespace.name, None, wanted)
            elif needs_update(current, wanted):
                ok &= self._write("update", namespace.name, current, wanted)
        return ok

    def _write(
        self, operation: str, namespace: str, current: ConfigMapInfo | None, wanted: Published
    ) -> bool:
        body = kubernetes.client.V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=kubernetes.client.V1ObjectMeta(
                name=CONFIGMAP_NAME,
                namespace=namespace,
                labels={**(current.labels if current else {}), **LABELS},
                annotations=current.annotations if current and current.annotations else None,
                resource_version=current.resource_version if current else None,
            ),
            data=wanted.data(current.data if current else {}),
        )

        def call() -> object:
            if current is None:
                return self._core.create_namespaced_config_map(
                    namespace, body, _request_timeout=_REQUEST_TIMEOUT
                )
            return self._core.replace_namespaced_config_map(
                CONFIGMAP_NAME, namespace, body, _request_timeout=_REQUEST_TIMEOUT
            )

        return guarded_write(
            f"{operation} {namespace}/{CONFIGMAP_NAME}",
            call,
            lambda result: self._metrics.root_configmap_writes.labels(operation, result).inc(),
            log,
        )
