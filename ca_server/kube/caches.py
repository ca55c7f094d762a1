"""The CA's cluster-wide caches — pods, and for offline validation ServiceAccounts — built once
per replica, and their gauges.

Which caches a replica needs follows from its flags alone (`cache_needs`): pods for the node
authorizer (`CA_TRUSTED_NODE_ACCOUNTS`), offline token validation or the Pod Certificate signer
(`--pod-certificate-signer`), ServiceAccounts for offline validation. A single CA process holds
them itself; with `--workers N` the supervisor holds them (`ca_server.serving.workers`) and
serves lookups to its workers over a Unix socket (`ca_server.kube.cache_service`), so memory
and the API server's LIST/WATCH load stay those of one cache per replica, whatever N.

Nothing waits for a cache to sync, and no deadline ends a long list: the CA serves at once,
requests that need a cache answer `UNAVAILABLE` with a retry hint until it has (offline
validation falls back to TokenReview meanwhile), and `/ready` answers 503 `syncing` with the
progress (objects listed so far) until every cache has synced; the gauges show it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import kubernetes.client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ca_server.config import KubeConfig
from ca_server.kube.pod_cache import PodCache
from ca_server.kube.ratelimit import AsyncTokenBucket
from ca_server.kube.service_account_cache import ServiceAccountCache
from ca_server.kube.watched_cache import CacheProgress
from meshca.clock import SystemClock

_JOIN_SECONDS = 2.0


def cache_needs(kube: KubeConfig) -> tuple[bool, bool]:
    """(pods, service accounts): the caches a replica with these flags needs."""
    offline = kube.token_review and kube.token_validation == "offline"
    pods = bool(kube.trusted_node_accounts) or offline or kube.pod_certificate_signer is not None
    return pods, offline


class LocalKubeCaches:
    """The caches this process holds, from `api`, started and stopped together."""

    def __init__(
        self, api: kubernetes.client.ApiClient, pods: bool, accounts: bool, kube: KubeConfig
    ) -> None:
        # Every page of both lists takes a token (client-go paces each request alike), from a
        # bucket of their own so a relist never delays a TokenReview.
        pages = AsyncTokenBucket(kube.qps, kube.burst, SystemClock())
        listing: dict[str, Any] = {
            "page_size": kube.list_page_size,
            "pace": pages.reserve,
            "stream_lists": kube.stream_lists,
        }
        self.pods = PodCache(api, **listing) if pods else None
        self.accounts = ServiceAccountCache(api, **listing) if accounts else None

    @classmethod
    def for_config(cls, api: kubernetes.client.ApiClient, kube: KubeConfig) -> LocalKubeCaches:
        return cls(api, *cache_needs(kube), kube)

    @property
    def any(self) -> bool:
        return self.pods is not None or self.accounts is not None

    def progress(self) -> list[CacheProgress]:
        return [cache.progress() for cache in (self.pods, self.accounts) if cache is not None]

    def start(self) -> None:
        for cache in (self.accounts, self.pods):
            if cache is not None:
                cache.start()

    def stop(self) -> None:
        for cache in (self.pods, self.accounts):
            if cache is not None:
                cache.stop()
        for cache in (self.pods, self.accounts):
            if cache is not None:
                cache.join(_JOIN_SECONDS)


def readiness_lines(progress: list[CacheProgress]) -> str:
    """What `/ready` adds below its first line: one line per cache."""
    return "".join(f"{item.line()}\n" for item in progress)


class KubeCacheCollector(Collector):
    """`meshca_ca_kube_cache_synced{resource}` (1 once the first list completed),
    `meshca_ca_kube_cache_objects{resource}` (held, or listed so far while syncing) and
    `meshca_ca_kube_cache_restarts{resource,cause}` (re-lists: `expired` after 410 Gone,
    `error`), read from the caches at each scrape — in the process that holds them."""

    def __init__(self, progress: Callable[[], list[CacheProgress]]) -> None:
        self._progress = progress

    def collect(self) -> Iterator[Metric]:
        synced = GaugeMetricFamily(
            "meshca_ca_kube_cache_synced",
            "1 once the cluster-wide cache has completed its first list",
            labels=["resource"],
        )
        objects = GaugeMetricFamily(
            "meshca_ca_kube_cache_objects",
            "Objects in the cluster-wide cache (listed so far while it syncs)",
            labels=["resource"],
        )
        restarts = CounterMetricFamily(
            "meshca_ca_kube_cache_restarts",
            "Re-lists of a cluster-wide cache, by resource and cause",
            labels=["resource", "cause"],
        )
        for item in self._progress():
            synced.add_metric([item.resource], 1.0 if item.synced else 0.0)
            objects.add_metric([item.resource], float(item.objects))
            for cause in ("expired", "error"):
                restarts.add_metric([item.resource, cause], float(item.restarts.get(cause, 0)))
        yield synced
        yield objects
        yield restarts
