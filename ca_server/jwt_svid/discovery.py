"""OIDC discovery for relying parties outside the mesh: the issuer's document and its JWKS.

Off unless `--oidc-listen` is given; then served on that address only (never on the gRPC or
monitoring ports) by the bounded HTTP server every daemon uses (`meshca.status_http`):

- `/.well-known/openid-configuration`: `issuer` (equal to every token's `iss`), `jwks_uri`,
  `id_token_signing_alg_values_supported`, `response_types_supported`, `subject_types_supported`;
- `/keys`: the JWKS, every key in a slot (prepared, active, old, tainted; gone once revoked or
  dropped), with `use: "sig"` (the SPIFFE bundle's `jwt-svid` is for SPIFFE clients; OIDC
  libraries look for `sig`).

Both answer with `Cache-Control: public, max-age=<--jwks-max-age>`; the driver activates a
prepared key only once it has been published that long (`keys.JwtKeyPolicy`), so a relying
party that honours the header has the new key before the first token it signs. Handlers read
the authority's published bytes, which the event loop replaces atomically.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ca_server.jwt_svid.driver import JwtAuthority
from certs.jwk import JWT_ALGORITHMS
from meshca.status_http import Response, StatusServer

DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/keys"


def default_issuer(listen_url: str) -> str:
    return listen_url.rstrip("/")


def discovery_document(issuer: str) -> dict[str, object]:
    return {
        "issuer": issuer,
        "jwks_uri": f"{issuer}{JWKS_PATH}",
        "id_token_signing_alg_values_supported": list(JWT_ALGORITHMS),
        "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"],
    }


def _document_route(issuer: Callable[[], str]) -> Callable[[], Response]:
    return lambda: (200, "application/json", json.dumps(discovery_document(issuer())).encode())


def discovery_server(listen: str, authority: JwtAuthority) -> StatusServer:
    """Bound at once (a busy address fails here, naming `--oidc-listen`); `start()` serves.
    Without `--oidc-issuer` the issuer is this server's URL, and the authority's tokens carry
    it as `iss` from now on."""
    max_age = int(authority.max_age.total_seconds())
    server = StatusServer(
        listen,
        {
            DISCOVERY_PATH: _document_route(lambda: authority.issuer or ""),
            JWKS_PATH: lambda: (200, "application/json", authority.oidc_jwks),
        },
        name="oidc",
        flag="--oidc-listen",
        headers={"Cache-Control": f"public, max-age={max_age}"},
    )
    if authority.issuer is None:  # the tokens' `iss` must be what the document says
        authority.issuer = default_issuer(server.url)
    return server
