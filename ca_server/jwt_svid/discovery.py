"""OIDC discovery for relying parties outside the mesh: the issuer's document and its JWKS.

Off unless `--oidc-listen` is given; then served on that address only (never on the gRPC or
monitoring ports) by the bounded HTTP server every daemon uses (`meshca.status_http`):

- `/.well-known/openid-configuration`: `issuer` (equal to every token's `iss`: `--oidc-issuer`,
  default `http://<--oidc-listen>`), `jwks_uri`, `id_token_signing_alg_values_supported`,
  `response_types_supported`, `subject_types_supported`;
- `/keys`: the JWKS, every key in a slot (prepared, active, old, tainted; gone once revoked or
  dropped), with `use: "sig"` (the SPIFFE bundle's `jwt-svid` is for SPIFFE clients; OIDC
  libraries look for `sig`).

Both answer with `Cache-Control: public, max-age=<--jwks-max-age>`; the driver activates a
prepared key only once it has been published that long (`keys.JwtKeyPolicy`), so a relying
party that honours the header has the new key before the first token it signs.

Who serves it: a single CA process from its running `JwtAuthority`; under `meshca ca --workers
N` the supervisor (one port for the group), from the shared store (`StoredJwks`, re-read at most
every `refresh` seconds when asked), while the workers sign with the same keys.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from ca_server.fleet import AgentCoverage, FleetReports, jwt_coverage
from ca_server.jwt_svid.keys import JwtKeyState
from ca_server.jwt_svid.store import JwtKeyStore
from certs.jwk import JWT_ALGORITHMS, jwks_document
from meshca.status_http import Response, StatusServer

DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/keys"


class PublishedJwks(Protocol):
    """What the discovery server reads: the JWKS for relying parties and the issuer."""

    @property
    def oidc_jwks(self) -> bytes: ...

    @property
    def issuer(self) -> str | None: ...


def agents_fields(coverage: AgentCoverage) -> dict[str, Any]:
    """A key's coverage as `meshca status` and `meshca authority show --jwt` print it: how
    many of the agents holding a JWT bundle hold the key, of how many counted (unseen ones
    included, as not holding), and what could not be read."""
    return {
        "holding": coverage.trusting,
        "counted": coverage.reporting + coverage.unseen,
        "unseen": coverage.unseen,
        "unreadable": coverage.unreadable,
        "text": coverage.said("hold"),
    }


def key_rows(
    state: JwtKeyState, coverage: dict[str, AgentCoverage] | None = None
) -> list[dict[str, Any]]:
    """Each published key (active, prepared, old), with its coverage where `coverage` has
    one (by kid)."""
    rows: list[dict[str, Any]] = []
    for key in state.ranked():
        row: dict[str, Any] = {
            "kid": key.kid,
            "algorithm": key.algorithm,
            "phase": key.phase.value,
            "tainted": key.tainted,
            "created_at": key.created_at.isoformat(),
            "expires_at": key.not_after.isoformat(),
        }
        if coverage is not None and key.kid in coverage:
            row["agents"] = agents_fields(coverage[key.kid])
        rows.append(row)
    return rows


def status_section(
    state: JwtKeyState,
    issuer: str | None,
    discovery: str | None,
    max_age: timedelta,
    coverage: dict[str, AgentCoverage] | None = None,
) -> dict[str, Any]:
    """What `meshca status` shows of JWT-SVIDs (`/debug/ca`'s `jwt_svid`): the issuer, where
    discovery is served, the cache lifetime it advertises, each published key (the prepared
    one with its agents' coverage, `coverage`), and why an activation waits, if it does."""
    waiting = state.gate_waiting()
    return {
        "issuer": issuer,
        "discovery": f"{discovery}{DISCOVERY_PATH}" if discovery else None,
        "jwks_max_age_seconds": int(max_age.total_seconds()),
        "keys": key_rows(state, coverage),
        "activation_waiting": waiting.reason if waiting is not None else None,
    }


def oidc_jwks_of(state: JwtKeyState) -> bytes:
    """The keys for OIDC relying parties: `use: "sig"`, what their libraries look for (pyjwt's
    `PyJWKClient` skips any other `use`), no SPIFFE members."""
    return jwks_document({**key, "use": "sig"} for key in state.published())


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


def discovery_server(listen: str, published: PublishedJwks, max_age: timedelta) -> StatusServer:
    """Bound at once (a busy address fails here, naming `--oidc-listen`); `start()` serves."""
    return StatusServer(
        listen,
        {
            DISCOVERY_PATH: _document_route(lambda: published.issuer or ""),
            JWKS_PATH: lambda: (200, "application/json", published.oidc_jwks),
        },
        name="oidc",
        flag="--oidc-listen",
        headers={"Cache-Control": f"public, max-age={int(max_age.total_seconds())}"},
    )


class StoredJwks:
    """The JWKS as the shared store holds it, for a process that does not sign (the workers'
    supervisor): re-read when asked and `refresh` seconds have passed (a store read is cheap:
    a file, or one GET of the Secret). Thread-safe: the HTTP handlers run on a pool."""

    def __init__(
        self,
        store: JwtKeyStore,
        issuer: str | None,
        refresh: float,
        fleet: Callable[[datetime], FleetReports] | None = None,
    ) -> None:
        self._store = store
        self.issuer = issuer
        self._refresh = refresh
        self._fleet = fleet  # every CA process's agent reports, for `coverage`
        self._coverage: tuple[float, str, AgentCoverage] | None = None
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._fingerprint = ""
        self._jwks = b""
        self._state: JwtKeyState | None = None

    @property
    def oidc_jwks(self) -> bytes:
        return oidc_jwks_of(self.state)

    @property
    def state(self) -> JwtKeyState:
        with self._lock:
            if self._state is None or time.monotonic() - self._read_at >= self._refresh:
                fingerprint = self._store.fingerprint()
                if fingerprint != self._fingerprint or self._state is None:
                    self._state = self._store.read()
                    self._fingerprint = fingerprint
                self._read_at = time.monotonic()
            return self._state

    def coverage(self) -> dict[str, AgentCoverage] | None:
        """The prepared key's coverage (what the workers' gate counts), re-read at most every
        `refresh` seconds when asked; None without a prepared key or a fleet to read."""
        prepared = self.state.prepared
        if prepared is None or self._fleet is None:
            return None
        with self._lock:
            cached = self._coverage
            if (
                cached is None
                or cached[1] != prepared.kid
                or (time.monotonic() - cached[0] >= self._refresh)
            ):
                counted = jwt_coverage(prepared.kid, self._fleet(datetime.now(UTC)))
                cached = self._coverage = (time.monotonic(), prepared.kid, counted)
            return {cached[1]: cached[2]}
