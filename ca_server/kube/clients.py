"""The CA's API clients: the local cluster's and the remote clusters', by cluster id.

The local cluster comes from `--kubeconfig` or, without it, the pod's in-cluster credentials.
Remote clusters (`--remote-kubeconfig ID=PATH`) are only used to review tokens whose request
carries `clusterid: ID`. Each client is built by `meshca.kube_client.build_api_client` (pool
size, retry, user agent naming this replica); a credentials failure stops start-up with
`CaSetupError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kubernetes.client import ApiClient

from ca_server.config import KubeConfig
from ca_server.errors import CaSetupError
from meshca.kube_client import KubeCredentialsError, build_api_client

USER_AGENT_PREFIX = "meshca-ca"


def _build(kubeconfig: Path | None, *, pool_size: int, user_agent: str) -> ApiClient:
    try:
        return build_api_client(kubeconfig, pool_size=pool_size, user_agent=user_agent)
    except KubeCredentialsError as exc:
        raise CaSetupError(str(exc)) from exc


@dataclass
class KubeClients:
    """The local cluster's client and the remote clusters' clients, by cluster id."""

    local_cluster_id: str
    local: ApiClient
    remote: Mapping[str, ApiClient]

    @classmethod
    def from_config(cls, config: KubeConfig) -> KubeClients:
        user_agent = f"{USER_AGENT_PREFIX}/{config.instance_id}"
        local = _build(
            config.kubeconfig, pool_size=config.connection_pool_size, user_agent=user_agent
        )
        remote = {
            cluster_id: _build(path, pool_size=4, user_agent=user_agent)
            for cluster_id, path in config.remote_kubeconfigs
        }
        return cls(config.cluster_id, local, remote)

    def for_cluster(self, cluster_id: str | None) -> ApiClient | None:
        """The client that may vouch for a token from `cluster_id` (`None`: the local one)."""
        if cluster_id is None or cluster_id == self.local_cluster_id:
            return self.local
        return self.remote.get(cluster_id)

    def close(self) -> None:
        for client in (self.local, *self.remote.values()):
            client.close()
