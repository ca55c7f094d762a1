"""What a `meshca ca --workers N` supervisor runs in Kubernetes mode: the replica's one set of
cluster-wide caches (`ca_server.kube.caches`), served to its workers (`cache_service`), with
their progress on its `/ready` and their gauges on its `/metrics`.

The supervisor builds these before any worker starts, from the same flags the workers read, so
a worker knows from its own flags that it must ask the supervisor (`KubernetesMode`).
"""

from __future__ import annotations

from pathlib import Path

from kubernetes.client import ApiClient

from ca_server.config import CaConfig
from ca_server.errors import CaSetupError
from ca_server.kube.cache_service import KubeCacheServer
from ca_server.kube.caches import KubeCacheCollector, LocalKubeCaches, cache_needs, readiness_lines
from ca_server.kube.clients import USER_AGENT_PREFIX
from meshca.kube_client import KubeCredentialsError, build_api_client


class SupervisorCaches:
    def __init__(self, caches: LocalKubeCaches, api: ApiClient) -> None:
        self.caches = caches
        self._api = api
        self._server: KubeCacheServer | None = None
        self.collector = KubeCacheCollector(caches.progress)

    @classmethod
    def for_config(cls, config: CaConfig) -> SupervisorCaches | None:
        """The caches the workers' flags need, or None (not Kubernetes mode, or none needed)."""
        kube = config.kube
        if kube is None or not any(cache_needs(kube)):
            return None
        try:
            api = build_api_client(
                kube.kubeconfig,
                pool_size=2,
                user_agent=f"{USER_AGENT_PREFIX}/{kube.instance_id}/caches",
            )
        except KubeCredentialsError as exc:
            raise CaSetupError(str(exc)) from exc
        return cls(LocalKubeCaches.for_config(api, kube), api)

    def start(self, socket_path: Path) -> None:
        """Serves lookups on `socket_path` (in the supervisor's run directory), then lists."""
        self._server = KubeCacheServer(self.caches, socket_path)
        self._server.start()
        self.caches.start()

    @property
    def synced(self) -> bool:
        return all(item.synced for item in self.caches.progress())

    def readiness_lines(self) -> str:
        return readiness_lines(self.caches.progress())

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self.caches.stop()
        self._api.close()
