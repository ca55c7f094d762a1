"""JWT-SVIDs: the signing keys every CA process shares, the RPC that signs tokens, and OIDC
discovery for relying parties outside the mesh (docs/jwt-svid.md).

    JwtAuthority (driver)        the keys in slots, as the X.509 authority's: prepared /
    │                            active / old, tainted; one set for every worker and replica
    ├── keys                     the pure rules (phases, schedule, the JWKS-age activation rule)
    ├── store                    `jwt-authority.json` in `--data-dir`, under its lock
    ├── minting                  one token's claims: `sub` authenticated, `aud` bounded
    ├── service                  `meshca.v1.JwtSvidService` (MintJwtSvid, FetchJwtBundle)
    └── discovery                `/.well-known/openid-configuration` and `/keys`

It sits beside `ca_server.authority` and reuses its phases, its operator error and its data
directory lock (through that facade); the X.509 authority never imports it. `ca_server.server`
builds it once (`jwt_authority_for`) and hands it to the service and the discovery server.
Concurrency: see `driver` (one coroutine on the CA's loop; store I/O in worker threads).
"""

from __future__ import annotations

from ca_server.config import CaConfig
from ca_server.jwt_svid.discovery import discovery_server
from ca_server.jwt_svid.driver import JwtAuthority
from ca_server.jwt_svid.keys import JwtKey, JwtKeyPolicy, JwtKeyState
from ca_server.jwt_svid.service import JwtSvidService, add_jwt_svid_service
from ca_server.jwt_svid.store import JWT_STATE_FILE, JwtKeyFactory, LocalJwtKeyStore
from meshca.clock import Clock

__all__ = [
    "JWT_STATE_FILE",
    "JwtAuthority",
    "JwtKey",
    "JwtKeyFactory",
    "JwtKeyPolicy",
    "JwtKeyState",
    "JwtSvidService",
    "LocalJwtKeyStore",
    "add_jwt_svid_service",
    "discovery_server",
    "jwt_authority_for",
]


def jwt_authority_for(config: CaConfig, clock: Clock) -> JwtAuthority:
    """The JWT authority `config` asks for, its keys in `--data-dir` (not started)."""
    jwt = config.jwt
    factory = JwtKeyFactory(jwt.key_algorithm, jwt.key_lifetime)
    policy = JwtKeyPolicy(
        lifetime=jwt.key_lifetime,
        max_token_ttl=jwt.token_ttl,
        jwks_max_age=jwt.jwks_max_age,
        automatic=config.root_rotation,
    )
    return JwtAuthority(
        LocalJwtKeyStore(config.data_dir, factory, clock),
        factory,
        policy,
        clock,
        poll_interval=config.plugged_ca_poll_interval.total_seconds(),
        issuer=jwt.oidc_issuer,
    )
