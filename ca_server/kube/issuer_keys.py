"""The cluster's service-account token issuer and its public keys, fetched through the API server.

Offline token validation needs what kube-apiserver publishes for ServiceAccountIssuerDiscovery:
the `issuer` from `/.well-known/openid-configuration` (what every token's `iss` must equal) and
the verification keys from `/openid/v1/jwks`. Both are read with the official client through the
API server itself — never from the discovery document's `jwks_uri`, which names the issuer's
public URL and is often unreachable from inside the cluster. The CA's RBAC grants `get` on these
two non-resource URLs (as the built-in `system:service-account-issuer-discovery` role does).

When keys are fetched:
- once at start (`load`), which fails start-up with an operator-facing message;
- when a token names a key id the cached set lacks (the issuer rotated its key): at most one
  refresh per `min_refresh_interval`, shared by every request that missed, so a flood of tokens
  with made-up key ids costs at most one API call per interval;
- in the background once the set is older than `max_age`, so a key the cluster withdrew stops
  being trusted without a restart. A failed refresh keeps the last good set (an API-server
  outage must not stop issuance for tokens we can still verify) and is tried again at most
  once per `min_refresh_interval`, not by every request that finds the set still old.

Concurrency: `key_for` runs where request handlers run (the RPC server's completion-queue
thread, or the event loop) while the current keys answer; before it starts or joins a refresh it
moves the handler to the loop (`loop_handoff.to_the_loop`), so the refresh task is created and
awaited there only. Every fetch is a blocking HTTP call on the synchronous client and runs in a
worker thread (`asyncio.to_thread`) under that loop task. Each piece of state is replaced
by one assignment (the key set by the refresh task, the refresh task by `key_for`), so no lock
is needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jwt
import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.errors import AuthenticationError, CaSetupError, DependencyUnavailableError
from ca_server.jwt_authn import find_key
from ca_server.loop_handoff import to_the_loop
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT = (2.0, 5.0)  # (connect, read) seconds


class IssuerDiscoveryError(Exception):
    """The API server did not give a usable discovery document or key set."""


@dataclass(frozen=True)
class IssuerKeySet:
    issuer: str
    keys: tuple[jwt.PyJWK, ...]
    fetched_at: float  # monotonic seconds


def _get_json(api: kubernetes.client.ApiClient, fetch: Callable[..., Any], what: str) -> Any:
    """One GET through a generated API method, decoded as JSON.

    The generated methods declare these documents as `str` and would hand back a Python repr of
    the parsed JSON; reading the raw body avoids that.
    """
    try:
        response = fetch(_preload_content=False, _request_timeout=_REQUEST_TIMEOUT)
        return json.loads(response.data)
    except ApiException as exc:
        raise IssuerDiscoveryError(f"GET {what}: {api_error_text(exc)}") from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise IssuerDiscoveryError(f"GET {what}: {type(exc).__name__}: {exc}") from exc
    except ValueError as exc:
        raise IssuerDiscoveryError(f"GET {what}: the answer is not JSON") from exc


def fetch_issuer_keys(api: kubernetes.client.ApiClient, fetched_at: float) -> IssuerKeySet:
    """Discovery document and JWKS, read through the API server (blocking)."""
    discovery = _get_json(
        api,
        kubernetes.client.WellKnownApi(api).get_service_account_issuer_open_id_configuration,
        "/.well-known/openid-configuration",
    )
    issuer = discovery.get("issuer") if isinstance(discovery, dict) else None
    if not isinstance(issuer, str) or not issuer:
        raise IssuerDiscoveryError("/.well-known/openid-configuration names no issuer")
    document = _get_json(
        api,
        kubernetes.client.OpenidApi(api).get_service_account_issuer_open_id_keyset,
        "/openid/v1/jwks",
    )
    try:
        key_set = jwt.PyJWKSet.from_dict(document)
    except (jwt.PyJWKSetError, jwt.InvalidKeyError, AttributeError, TypeError) as exc:
        raise IssuerDiscoveryError(f"/openid/v1/jwks holds no usable key: {exc}") from exc
    return IssuerKeySet(issuer, tuple(key_set.keys), fetched_at)


class ClusterIssuerKeys:
    """A `jwt_authn.KeySource` for the local cluster's service-account issuer."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        *,
        monotonic: Callable[[], float],
        min_refresh_interval: float = 10.0,
        max_age: float = 300.0,
    ) -> None:
        self._api = api
        self._monotonic = monotonic
        self._min_refresh_interval = min_refresh_interval
        self._max_age = max_age
        self._current: IssuerKeySet | None = None
        # Refreshes after start-up (a kid miss, or keys past `max_age`); the first miss always
        # fetches, so a key rotated while the CA was starting is found.
        self._last_attempt = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None

    @property
    def issuer(self) -> str:
        """The cluster's issuer (`iss` of its tokens); only valid after `load`."""
        if self._current is None:
            raise RuntimeError("ClusterIssuerKeys.load() has not run")
        return self._current.issuer

    def load(self) -> None:
        """The first fetch (blocking; call from a worker thread at start-up)."""
        try:
            self._current = fetch_issuer_keys(self._api, self._monotonic())
        except IssuerDiscoveryError as exc:
            raise CaSetupError(
                f"offline token validation cannot read the cluster's token issuer keys: {exc}; "
                "the CA needs get on the non-resource URLs /.well-known/openid-configuration "
                "and /openid/v1/jwks (ServiceAccountIssuerDiscovery), or use "
                "--token-validation tokenreview"
            ) from exc
        log.info(
            "service-account issuer %s: %d verification key(s) loaded",
            self._current.issuer,
            len(self._current.keys),
        )

    async def key_for(self, kid: str | None) -> jwt.PyJWK:
        current = self._current
        if current is None:
            raise DependencyUnavailableError(
                "issuer-keys-unavailable", "the CA has not loaded the cluster's issuer keys yet"
            )
        if (
            self._monotonic() - current.fetched_at >= self._max_age
            and self._refresh_allowed()  # a failing refresh is retried once per interval
            and not self._refresh_running()
        ):
            await to_the_loop()  # a task follows
            self._start_refresh()  # in the background; the current keys still answer
        key = find_key(current.keys, kid)
        if key is not None:
            return key
        if kid is not None and self._refresh_allowed():
            await to_the_loop()
            self._start_refresh()
        refreshing = self._refreshing
        if refreshing is not None:
            if not refreshing.done():
                await to_the_loop()  # joining a running task adds a callback to it
            await asyncio.shield(refreshing)
            key = find_key(self._current.keys if self._current else (), kid)
            if key is not None:
                return key
        return self._refuse(kid)

    def _refuse(self, kid: str | None) -> jwt.PyJWK:
        if kid is None:
            raise AuthenticationError(
                "jwt-no-kid",
                "token has no 'kid' header and the cluster's issuer publishes several keys",
            )
        raise AuthenticationError(
            "jwt-unknown-kid",
            f"token was signed with key id {kid!r}, which the cluster's service-account issuer "
            "does not publish (not a token of this cluster, or a withdrawn key)",
        )

    def _refresh_allowed(self) -> bool:
        return self._monotonic() - self._last_attempt >= self._min_refresh_interval

    def _refresh_running(self) -> bool:
        return self._refreshing is not None and not self._refreshing.done()

    def _start_refresh(self) -> None:
        # Checked again here, on the loop: a refresh may have started and ended while the
        # request moved to it (`to_the_loop`).
        if not self._refresh_running() and self._refresh_allowed():
            self._last_attempt = self._monotonic()
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            fresh = await asyncio.to_thread(fetch_issuer_keys, self._api, self._monotonic())
        except IssuerDiscoveryError as exc:
            log.warning("could not refresh the issuer keys (keeping the last good set): %s", exc)
            return
        except Exception:
            # Runs as a task others await: a bug here must not surface as their failure.
            log.exception("refreshing the issuer keys failed unexpectedly; keeping the last set")
            return
        if self._current is not None and fresh.issuer != self._current.issuer:
            log.warning(
                "the cluster's service-account issuer changed from %s to %s; tokens of the new "
                "issuer are refused until the CA restarts",
                self._current.issuer,
                fresh.issuer,
            )
        self._current = fresh
