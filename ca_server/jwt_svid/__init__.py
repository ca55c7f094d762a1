"""JWT-SVIDs: the signing keys every CA process shares, the RPC that signs tokens, and OIDC
discovery for relying parties outside the mesh (docs/jwt-svid.md).

    JwtAuthority (driver)        the keys in slots, as the X.509 authority's: prepared /
    │                            active / old, tainted; one set for every worker and replica
    ├── keys                     the pure rules (phases, schedule, the JWKS-age activation rule)
    ├── store                    `jwt-authority.json` in `--data-dir`, under its lock;
    │                            `kube_store`: Secret `meshca-jwt-keys` (Kubernetes mode)
    ├── minting                  one token's claims: `sub` authenticated, `aud` bounded
    ├── service                  `meshca.v1.JwtSvidService` (MintJwtSvid, FetchJwtBundle)
    └── discovery                `/.well-known/openid-configuration` and `/keys`

It sits beside `ca_server.authority` and reuses its phases, its operator error and its data
directory lock (through that facade); the X.509 authority never imports it. `ca_server.server`
builds it once (`jwt_authority_for`) and hands it to the service and the discovery server.
Concurrency: see `driver` (one coroutine on the CA's loop; store I/O in worker threads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from ca_server.config import CaConfig
from ca_server.fleet import DirectoryLedgerSink, FleetReports
from ca_server.jwt_svid.discovery import (
    StoredJwks,
    discovery_server,
    key_rows,
    status_section,
)
from ca_server.jwt_svid.driver import JwtAuthority
from ca_server.jwt_svid.keys import JwtKey, JwtKeyPolicy, JwtKeyState
from ca_server.jwt_svid.service import JwtSvidService, add_jwt_svid_service
from ca_server.jwt_svid.store import (
    JWT_STATE_FILE,
    JwtKeyFactory,
    JwtKeyStore,
    LocalJwtKeyStore,
)
from meshca.clock import Clock

__all__ = [
    "JWT_STATE_FILE",
    "JwtAuthority",
    "JwtKey",
    "JwtKeyFactory",
    "JwtKeyPolicy",
    "JwtKeyState",
    "JwtKeyStore",
    "JwtSvidService",
    "LocalJwtKeyStore",
    "StoredJwks",
    "add_jwt_svid_service",
    "cluster_jwt_key_store",
    "discovery_server",
    "jwt_authority_for",
    "key_rows",
    "status_section",
    "stored_jwks_for",
]


def _store_for(config: CaConfig, clock: Clock, cluster_api: Any | None) -> JwtKeyStore:
    """Secret `meshca-jwt-keys` of the CA's namespace when `cluster_api` (a Kubernetes
    `ApiClient`) is given, else `--data-dir`."""
    factory = JwtKeyFactory(config.jwt.key_algorithm, config.jwt.key_lifetime)
    if cluster_api is not None and config.kube is not None:
        # Imported here: the Kubernetes client loads only in Kubernetes mode.
        from ca_server.jwt_svid.kube_store import KubeJwtKeyStore

        return KubeJwtKeyStore(cluster_api, config.kube.namespace, factory, clock)
    return LocalJwtKeyStore(config.data_dir, factory, clock)


def stored_jwks_for(config: CaConfig, clock: Clock) -> StoredJwks:
    """What `meshca ca --workers N`'s supervisor serves on `--oidc-listen`: the keys its
    workers share, read from the same store (its own API client in Kubernetes mode), and for
    its status the prepared key's coverage from the reports the workers publish."""
    api = None
    fleet: Callable[[datetime], FleetReports]
    if config.kube is not None:
        from ca_server.kube.replica_reports import ConfigMapLedgerSink
        from meshca.kube_client import build_api_client

        agent = f"meshca-ca/{config.kube.instance_id}-supervisor"
        api = build_api_client(config.kube.kubeconfig, pool_size=2, user_agent=agent)
        fleet = ConfigMapLedgerSink(api, config.kube.namespace, agent).agents
    else:
        fleet = DirectoryLedgerSink(config.data_dir, "supervisor").agents
    store = _store_for(config, clock, api)
    refresh = config.plugged_ca_poll_interval.total_seconds()
    return StoredJwks(store, config.jwt.issuer, refresh, fleet)


def jwt_authority_for(
    config: CaConfig,
    clock: Clock,
    cluster_api: Any | None = None,
    fleet: Callable[[datetime], FleetReports] | None = None,
    registry: CollectorRegistry | None = None,
) -> JwtAuthority:
    """The JWT authority `config` asks for (not started), its keys where `_store_for` says;
    its activation gate counts the agents in `fleet` (every CA process's reports, merged; the
    authority driver's `agents`)."""
    jwt = config.jwt
    factory = JwtKeyFactory(jwt.key_algorithm, jwt.key_lifetime)
    store = _store_for(config, clock, cluster_api)
    policy = JwtKeyPolicy(
        lifetime=jwt.key_lifetime,
        max_token_ttl=jwt.token_ttl,
        jwks_max_age=jwt.jwks_max_age,
        automatic=config.root_rotation,
        activate_at_coverage=jwt.activate_at_coverage,
        activate_deadline=config.activate_deadline,
    )
    return JwtAuthority(
        store,
        factory,
        policy,
        clock,
        poll_interval=config.plugged_ca_poll_interval.total_seconds(),
        issuer=jwt.issuer,
        fleet=fleet,
        registry=registry,
    )


@contextlib.contextmanager
def cluster_jwt_key_store(
    kubeconfig: Path | None, namespace: str, factory: JwtKeyFactory, clock: Clock, agent: str
) -> Iterator[Any]:
    """The keys in Secret `meshca-jwt-keys` of `namespace` in the cluster of `kubeconfig`, for
    `meshca authority --jwt` (`agent` names it to the API server). Raises `CaSetupError` for
    unusable cluster credentials."""
    # Imported here: the Kubernetes client loads only for `--kubeconfig`.
    from ca_server.errors import CaSetupError
    from ca_server.jwt_svid.kube_store import KubeJwtKeyStore
    from meshca.kube_client import KubeCredentialsError, build_api_client

    try:
        api = build_api_client(kubeconfig, pool_size=2, user_agent=agent)
    except KubeCredentialsError as exc:
        raise CaSetupError(str(exc)) from None
    try:
        yield KubeJwtKeyStore(api, namespace, factory, clock)
    finally:
        api.close()
