"""The one place that builds `kubernetes.client.ApiClient`s.

The local cluster comes from `--kubeconfig` or, without it, the pod's in-cluster credentials.
Remote clusters (`--remote-kubeconfig ID=PATH`) are only used to review tokens whose request
carries `clusterid: ID`. Each client gets a deliberate connection-pool size (long-lived watches
each hold a connection), one retry for a dropped connection, and a user agent naming this
replica so API-server audit logs can tell replicas apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import kubernetes.client
import kubernetes.config

from ca_server.config import KubeConfig
from ca_server.root_store import CaSetupError

USER_AGENT_PREFIX = "meshca-ca"


def build_api_client(
    kubeconfig: Path | None, *, pool_size: int, user_agent: str
) -> kubernetes.client.ApiClient:
    """An `ApiClient` for the cluster in `kubeconfig` (its current context), or in-cluster."""
    configuration = kubernetes.client.Configuration()
    try:
        if kubeconfig is None:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        else:
            kubernetes.config.load_kube_config(
                config_file=str(kubeconfig),
                client_configuration=configuration,
                persist_config=False,
            )
    except (kubernetes.config.ConfigException, OSError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"
        raise CaSetupError(f"cannot load Kubernetes credentials from the {where}: {exc}") from exc
    configuration.connection_pool_maxsize = pool_size
    configuration.retries = 1
    client = kubernetes.client.ApiClient(configuration)
    client.user_agent = user_agent
    return client


@dataclass
class KubeClients:
    """The local cluster's client and the remote clusters' clients, by cluster id."""

    local_cluster_id: str
    local: kubernetes.client.ApiClient
    remote: Mapping[str, kubernetes.client.ApiClient]

    @classmethod
    def from_config(cls, config: KubeConfig) -> KubeClients:
        user_agent = f"{USER_AGENT_PREFIX}/{config.instance_id}"
        local = build_api_client(
            config.kubeconfig, pool_size=config.connection_pool_size, user_agent=user_agent
        )
        remote = {
            cluster_id: build_api_client(path, pool_size=4, user_agent=user_agent)
            for cluster_id, path in config.remote_kubeconfigs
        }
        return cls(config.cluster_id, local, remote)

    def for_cluster(self, cluster_id: str | None) -> kubernetes.client.ApiClient | None:
        """The client that may vouch for a token from `cluster_id` (`None`: the local one)."""
        if cluster_id is None or cluster_id == self.local_cluster_id:
            return self.local
        return self.remote.get(cluster_id)

    def close(self) -> None:
        for client in (self.local, *self.remote.values()):
            client.close()
