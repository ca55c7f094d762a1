"""Every ServiceAccount's uid, from a watch: what offline token validation needs to refuse the
tokens of a deleted (or deleted and re-created) account, as TokenReview does.

A projected token names its ServiceAccount by name *and* uid (`kubernetes.io.serviceaccount`).
The API server's TokenReview refuses it once that object is gone or has another uid; offline
validation (`ca_server.kube.bound_tokens`) asks this cache instead of the API server. It keeps
one string per account, listed page by page from raw JSON (`meshca.paged_informer`).

`AccountLookup` is what validation needs; with `--workers N` the workers ask the supervisor's
one cache through `ca_server.kube.cache_client`.

Concurrency: see `Informer` — the watch runs in its own thread; lookups from the event loop
take a lock held only for dictionary operations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import kubernetes.client

from ca_server.kube.watched_cache import CacheProgress, WatchedCache
from meshca.paged_informer import DEFAULT_PAGE_SIZE


class AccountLookup(Protocol):
    @property
    def synced(self) -> bool: ...

    def progress(self) -> CacheProgress: ...

    def uid(self, namespace: str, name: str) -> str | None: ...

    async def fetch_uid(self, namespace: str, name: str) -> str | None:
        """`uid` for the event loop: never waits on a socket there."""
        ...


def _account_uid(account: dict[str, Any]) -> str:
    return str((account.get("metadata") or {}).get("uid") or "")


class ServiceAccountCache(WatchedCache[str]):
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        pace: Callable[[], float] = lambda: 0.0,
        stream_lists: bool = True,
    ) -> None:
        core = kubernetes.client.CoreV1Api(api)
        super().__init__(
            "serviceaccounts",
            core.list_service_account_for_all_namespaces,
            _account_uid,
            page_size=page_size,
            pace=pace,
            stream_lists=stream_lists,
        )

    def uid(self, namespace: str, name: str) -> str | None:
        """The uid of ServiceAccount `namespace/name`; None when it does not exist."""
        return self._informer.get((namespace, name))

    async def fetch_uid(self, namespace: str, name: str) -> str | None:
        return self.uid(namespace, name)
