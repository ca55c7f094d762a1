"""Every ServiceAccount's uid, from a watch: what offline token validation needs to refuse the
tokens of a deleted (or deleted and re-created) account, as TokenReview does.

A projected token names its ServiceAccount by name *and* uid (`kubernetes.io.serviceaccount`).
The API server's TokenReview refuses it once that object is gone or has another uid; offline
validation (`ca_server.kube.bound_tokens`) asks this cache instead of the API server. It keeps
one string per account, so a cluster's accounts cost little memory next to the pod informer.

Concurrency: see `Informer` — the watch runs in its own thread; lookups from the event loop
take a lock held only for dictionary operations.
"""

from __future__ import annotations

from typing import Any

import kubernetes.client

from ca_server.metrics import CaMetrics
from meshca.informer import Informer


def _account_uid(account: Any) -> str:
    return str(account.metadata.uid or "")


class ServiceAccountCache:
    def __init__(self, api: kubernetes.client.ApiClient, metrics: CaMetrics) -> None:
        core = kubernetes.client.CoreV1Api(api)
        self._informer: Informer[str] = Informer(
            "serviceaccounts",
            core.list_service_account_for_all_namespaces,
            _account_uid,
            on_restart=lambda cause: metrics.kube_watch_restarts.labels(
                "serviceaccounts", cause
            ).inc(),
        )

    @property
    def synced(self) -> bool:
        return self._informer.synced

    def wait_synced(self, timeout: float) -> bool:
        return self._informer.wait_synced(timeout)

    def start(self) -> None:
        self._informer.start()

    def stop(self) -> None:
        self._informer.stop()

    def uid(self, namespace: str, name: str) -> str | None:
        """The uid of ServiceAccount `namespace/name`; None when it does not exist."""
        return self._informer.get((namespace, name))
