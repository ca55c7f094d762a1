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

from ca_server.kube.watched_cache import WatchedCache
from ca_server.metrics import CaMetrics


def _account_uid(account: Any) -> str:
    return str(account.metadata.uid or "")


class ServiceAccountCache(WatchedCache[str]):
    def __init__(self, api: kubernetes.client.ApiClient, metrics: CaMetrics) -> None:
        core = kubernetes.client.CoreV1Api(api)
        super().__init__(
            "serviceaccounts", core.list_service_account_for_all_namespaces, _account_uid, metrics
        )

    def uid(self, namespace: str, name: str) -> str | None:
        """The uid of ServiceAccount `namespace/name`; None when it does not exist."""
        return self._informer.get((namespace, name))
