"""The CA's configuration: one typed object built once from flags, then passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from certs import DEFAULT_TRUST_DOMAIN, KeySpec

DEFAULT_AUDIENCE = "istio-ca"
DEFAULT_SERVING_HOSTS = ("localhost", "127.0.0.1", "istiod.istio-system.svc")
DEFAULT_NAMESPACE = "istio-system"
DEFAULT_CLUSTER_ID = "Kubernetes"


@dataclass(frozen=True)
class JwtIssuerConfig:
    """One trusted token issuer: its `iss`, where its keys are (file or URL), accepted audiences."""

    issuer: str
    jwks: str
    audiences: tuple[str, ...] = (DEFAULT_AUDIENCE,)


@dataclass(frozen=True)
class TtlPolicy:
    """Workload certificate lifetimes: requests are clamped into [minimum, maximum]."""

    default: timedelta = timedelta(hours=24)
    maximum: timedelta = timedelta(days=90)
    minimum: timedelta = timedelta(minutes=10)

    def __post_init__(self) -> None:
        if not timedelta(0) < self.minimum <= self.default <= self.maximum:
            raise ValueError(
                "workload certificate TTLs must satisfy 0 < minimum <= default <= maximum "
                f"(got minimum={self.minimum}, default={self.default}, maximum={self.maximum})"
            )


@dataclass(frozen=True)
class KubeConfig:
    """Kubernetes mode: where the API server is and what the CA does with it.

    `kubeconfig=None` means in-cluster credentials (the pod's service account). Remote clusters
    are only asked to review tokens whose request names them in the `clusterid` header.
    """

    kubeconfig: Path | None = None
    remote_kubeconfigs: tuple[tuple[str, Path], ...] = ()
    namespace: str = DEFAULT_NAMESPACE
    cluster_id: str = DEFAULT_CLUSTER_ID
    token_review: bool = True
    audiences: tuple[str, ...] = (DEFAULT_AUDIENCE,)
    trusted_node_accounts: tuple[tuple[str, str], ...] = ()
    # Names this replica in the leader Lease and in its API user agent.
    instance_id: str = "meshca"
    # TokenReview calls per second (sustained) and burst, per CA process.
    qps: float = 50.0
    burst: int = 100
    # HTTP connections kept per API server: the long-lived watches plus concurrent reviews.
    connection_pool_size: int = 16
    publish_root: bool = True
    lease_duration: timedelta = timedelta(seconds=15)
    resync_interval: timedelta = timedelta(seconds=60)


@dataclass(frozen=True)
class CaConfig:
    data_dir: Path
    listen: str = "127.0.0.1:15012"
    mtls_listen: str | None = None
    monitoring_listen: str = "127.0.0.1:15014"
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    cacerts_dir: Path | None = None
    jwt_issuers: tuple[JwtIssuerConfig, ...] = ()
    trust_dev_issuer: bool = True
    ttl: TtlPolicy = field(default_factory=TtlPolicy)
    root_key: KeySpec = field(default_factory=KeySpec)
    root_lifetime: timedelta = timedelta(days=3650)
    serving_hosts: tuple[str, ...] = DEFAULT_SERVING_HOSTS
    serving_cert_lifetime: timedelta = timedelta(days=365)
    plugged_ca_poll_interval: timedelta = timedelta(seconds=5)
    shutdown_grace: timedelta = timedelta(seconds=2)
    kube: KubeConfig | None = None
