"""Offline JWT authentication against a JWKS (file or URL), for Kubernetes-shaped tokens.

The token must be a projected service-account token (docs/reference.md#service-account-tokens):
asymmetric signature from a trusted issuer's JWKS, `aud` containing an accepted audience, valid
`exp`/`nbf`, and `sub = system:serviceaccount:<ns>:<sa>` agreeing with the `kubernetes.io` claim.
Verified tokens are cached (`ca_server.token_cache`: by digest, never the token itself) until they
expire, at most five minutes, so a burst of renewals with the same token costs one signature check
and a JWKS key withdrawn after a leak stops being honoured from the cache within minutes.

Concurrency: runs where the RPC server runs the handler (its completion-queue thread, or the
event loop) while the verified-token cache answers; a token that needs the issuer's keys moves the
handler to the loop first (`loop_handoff.to_the_loop`), since reading a JWKS file or fetching a JWKS
URL blocks and so runs in a worker thread the loop waits for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import jwt

from ca_server.authn import AuthnRequest, Caller
from ca_server.config import JwtIssuerConfig
from ca_server.errors import AuthenticationError
from ca_server.loop_handoff import to_the_loop
from ca_server.token_cache import VerifiedTokenCache, token_digest
from certs import CertsError, SpiffeId
from meshca.accounts import account_from_username
from meshca.clock import Clock
from meshca.safe_read import read_regular_file
from meshca.waiting import result_within

log = logging.getLogger(__name__)

# Asymmetric only: HS* would let anyone holding the (public) JWKS forge tokens.
ALLOWED_ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "PS256", "PS384", "PS512")
_LEEWAY_SECONDS = 30
_MAX_JWKS_BYTES = 1024 * 1024


class KeySource(Protocol):
    """Where an issuer's public keys come from."""

    async def key_for(self, kid: str | None) -> jwt.PyJWK: ...


class JwksFile:
    """A JWKS JSON file, re-read when its modification time changes (rotated issuer keys).

    The stat and read run in a worker thread under a timeout, and only a small regular file is
    read (`meshca.safe_read`): a JWKS path on a stuck mount, or replaced by a FIFO, must not
    stall the event loop that serves every other request. Concurrent cache misses share one
    read, and a read that timed out is not started again until it ends: its thread cannot be
    cancelled, and one per request would use up the worker threads.

    A key of the set looked at less than `recheck_interval` ago (1 s) is answered from it with
    no thread and no wait, so a storm of new tokens (the development issuer's) is verified
    inline on the completion-queue thread: with a stat per token, each one was handed to the
    loop, waited there for the CPU counted as in flight, and the CA shed a storm grpc.aio's
    server took whole (2,000 identities: 2,556 refusals and 163 certificates/s vs none and
    ~1,000/s). A key id the set lacks is always looked for in the file; a key withdrawn from
    the file is honoured for at most that second longer (verified tokens are cached for
    minutes anyway, `ca_server.token_cache`).
    """

    def __init__(
        self,
        path: Path,
        read_timeout: float = 5.0,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        recheck_interval: float = 1.0,
    ) -> None:
        self._path = path
        self._read_timeout = read_timeout
        self._monotonic = monotonic
        self._recheck_interval = recheck_interval
        self._mtime: float | None = None
        self._keys: jwt.PyJWKSet | None = None
        self._checked_at = -math.inf  # when the file was last looked at (the set is as of then)
        self._reading: asyncio.Future[jwt.PyJWKSet] | None = None

    async def key_for(self, kid: str | None) -> jwt.PyJWK:
        keys = self._keys
        if keys is not None and self._monotonic() - self._checked_at < self._recheck_interval:
            key = find_key(keys.keys, kid)
            if key is not None:
                return key
        await to_the_loop()  # a task and a timer follow
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(asyncio.to_thread(self._current_keys))
        try:
            keys = await result_within(self._reading, self._read_timeout)
        except TimeoutError:
            raise AuthenticationError(
                "jwks-unavailable",
                f"reading the issuer's JWKS file {self._path} did not finish within "
                f"{self._read_timeout:g}s",
            ) from None
        except (OSError, jwt.PyJWKSetError) as exc:
            raise AuthenticationError(
                "jwks-unavailable", f"cannot read the issuer's JWKS file {self._path}: {exc}"
            ) from exc
        return _pick_key(keys.keys, kid, str(self._path))

    def _current_keys(self) -> jwt.PyJWKSet:
        """Runs in a worker thread: the cached set, or the file re-read if it changed."""
        looked_at = self._monotonic()
        mtime = self._path.stat().st_mtime
        keys = self._keys
        if keys is None or mtime != self._mtime:
            keys = jwt.PyJWKSet.from_json(read_regular_file(self._path, _MAX_JWKS_BYTES).decode())
            self._keys, self._mtime = keys, mtime
        self._checked_at = looked_at
        return keys


class JwksUrl:
    """A JWKS served over HTTP(S), fetched and cached by PyJWT's `PyJWKClient`.

    As `JwksFile`: a key of the set obtained less than `recheck_interval` ago answers inline,
    without a worker thread (the client's own cache needs one per call, since it may fetch)."""

    def __init__(
        self,
        url: str,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        recheck_interval: float = 1.0,
    ) -> None:
        self._client = jwt.PyJWKClient(url, cache_keys=True, lifespan=300, timeout=5)
        self._url = url
        self._monotonic = monotonic
        self._recheck_interval = recheck_interval
        self._keys: Sequence[jwt.PyJWK] = ()
        self._checked_at = -math.inf

    async def key_for(self, kid: str | None) -> jwt.PyJWK:
        if self._monotonic() - self._checked_at < self._recheck_interval:
            key = find_key(self._keys, kid)
            if key is not None:
                return key
        await to_the_loop()  # the fetch is the loop's to start and to wait for
        looked_at = self._monotonic()
        try:
            keys = await asyncio.to_thread(self._client.get_signing_keys)
        except jwt.PyJWKClientError as exc:
            raise AuthenticationError(
                "jwks-unavailable", f"cannot fetch the issuer's JWKS from {self._url}: {exc}"
            ) from exc
        self._keys, self._checked_at = keys, looked_at
        return _pick_key(keys, kid, self._url)


def find_key(keys: Sequence[jwt.PyJWK], kid: str | None) -> jwt.PyJWK | None:
    """The key `kid` names in a JWKS, or its only key for a token without `kid`; else `None`."""
    if kid is None:
        return keys[0] if len(keys) == 1 else None
    for key in keys:
        if key.key_id == kid:
            return key
    return None


def _pick_key(keys: Sequence[jwt.PyJWK], kid: str | None, where: str) -> jwt.PyJWK:
    key = find_key(keys, kid)
    if key is not None:
        return key
    if kid is None:
        raise AuthenticationError(
            "jwt-no-kid", f"token has no 'kid' header and the JWKS at {where} holds several keys"
        )
    raise AuthenticationError(
        "jwt-unknown-kid", f"token was signed with key id {kid!r}, which the JWKS at {where} lacks"
    )


def key_source_for(jwks: str, monotonic: Callable[[], float] = time.monotonic) -> KeySource:
    if jwks.startswith(("http://", "https://")):
        return JwksUrl(jwks, monotonic=monotonic)
    return JwksFile(Path(jwks), monotonic=monotonic)


@dataclass(frozen=True)
class TrustedIssuer:
    issuer: str
    keys: KeySource
    audiences: tuple[str, ...]


class JwtAuthenticator:
    """Authenticates bearer tokens from any of the trusted issuers."""

    name = "jwt"

    def __init__(
        self,
        issuers: Sequence[TrustedIssuer],
        trust_domain: str,
        clock: Clock,
        cache_size: int = 10_000,
    ) -> None:
        self._issuers = {issuer.issuer: issuer for issuer in issuers}
        self._trust_domain = trust_domain
        self._clock = clock
        self._cache: VerifiedTokenCache[Caller] = VerifiedTokenCache(max_entries=cache_size)

    @classmethod
    def from_config(
        cls, configs: Sequence[JwtIssuerConfig], trust_domain: str, clock: Clock
    ) -> JwtAuthenticator:
        issuers = [
            TrustedIssuer(c.issuer, key_source_for(c.jwks, clock.monotonic), c.audiences)
            for c in configs
        ]
        return cls(issuers, trust_domain, clock)

    async def authenticate(self, request: AuthnRequest) -> Caller | None:
        token = request.bearer_token
        if token is None:
            return None
        digest = token_digest(self.name, token)
        cached = self._cache.get(digest, self._clock.now())
        if cached is not None:
            return cached
        caller, expires_at = await self._verify(token)
        self._cache.put(digest, caller, self._clock.now(), expires_at)
        return caller

    async def _verify(self, token: str) -> tuple[Caller, datetime | None]:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError as exc:
            raise AuthenticationError(
                "jwt-malformed", "bearer token is not a well-formed JWT"
            ) from exc
        algorithm = header.get("alg")
        if algorithm not in ALLOWED_ALGORITHMS:
            raise AuthenticationError(
                "jwt-algorithm",
                f"token algorithm {algorithm!r} is not accepted; service-account tokens are "
                f"signed with one of {', '.join(ALLOWED_ALGORITHMS)}",
            )
        issuer = self._issuers.get(str(unverified.get("iss")))
        if issuer is None:
            raise AuthenticationError(
                "jwt-issuer",
                f"token issuer {unverified.get('iss')!r} is not trusted by this CA "
                f"(trusted: {sorted(self._issuers)})",
            )
        key = await issuer.keys.key_for(header.get("kid"))
        try:
            claims = jwt.decode(
                token,
                key=key,
                algorithms=[algorithm],
                audience=list(issuer.audiences),
                issuer=issuer.issuer,
                leeway=_LEEWAY_SECONDS,
                options={"require": ["exp", "iss", "sub", "aud"]},
            )
        except jwt.ExpiredSignatureError as exc:
            raise AuthenticationError(
                "jwt-expired",
                "token has expired; the kubelet refreshes projected tokens: re-read the token file",
            ) from exc
        except jwt.ImmatureSignatureError as exc:
            raise AuthenticationError(
                "jwt-not-yet-valid",
                "token is not valid yet (nbf/iat in the future): check clock skew between nodes",
            ) from exc
        except jwt.InvalidAudienceError as exc:
            raise AuthenticationError(
                "jwt-audience",
                "token audience is not accepted; request "
                f"a token with audience {list(issuer.audiences)}",
            ) from exc
        except jwt.InvalidIssuerError as exc:
            raise AuthenticationError("jwt-issuer", "token issuer is not trusted") from exc
        except jwt.InvalidSignatureError as exc:
            raise AuthenticationError(
                "jwt-signature", "token signature does not verify against the issuer's keys"
            ) from exc
        except jwt.PyJWTError as exc:
            raise AuthenticationError("jwt-invalid", f"token rejected: {exc}") from exc
        return self._caller_from_claims(claims), _expiry(claims["exp"])

    def _caller_from_claims(self, claims: dict[str, Any]) -> Caller:
        subject = str(claims.get("sub", ""))
        account = account_from_username(subject)
        if account is None:
            raise AuthenticationError(
                "jwt-subject",
                "token subject is not a service account (system:serviceaccount:<ns>:<sa>)",
            )
        namespace, service_account = account
        k8s = claims.get("kubernetes.io")
        pod_name = pod_uid = account_uid = None
        if k8s is not None:
            claimed_ns = _field(k8s, "namespace")
            claimed_account = _field(k8s, "serviceaccount")
            claimed_sa = _field(claimed_account, "name")
            account_uid = _field(claimed_account, "uid")
            if (claimed_ns, claimed_sa) != (namespace, service_account):
                raise AuthenticationError(
                    "jwt-subject", "token's kubernetes.io claim disagrees with its subject"
                )
            pod = _field(k8s, "pod")
            pod_name, pod_uid = _field(pod, "name"), _field(pod, "uid")
        try:
            identity = SpiffeId(self._trust_domain, namespace, service_account)
        except CertsError as exc:
            raise AuthenticationError("jwt-subject", f"token subject: {exc}") from exc
        return Caller(
            identity,
            self.name,
            subject=subject,
            pod_name=pod_name,
            pod_uid=pod_uid,
            service_account_uid=account_uid if isinstance(account_uid, str) else None,
        )


def _expiry(exp: float) -> datetime | None:
    """`exp` as a datetime; `None` (the cache's own cap applies) when it is beyond what a
    datetime holds. A signed token may say year 10000; that must not become a server error
    (found by the property tests in tests/hostile/test_properties.py)."""
    try:
        return datetime.fromtimestamp(exp, UTC)
    except (OverflowError, OSError, ValueError):
        return None


def _field(claim: Any, name: str) -> Any:
    """`claim[name]` for a JSON object claim, None when absent; a claim of the wrong shape (a
    string where Kubernetes puts an object) is an authentication failure, not a server error."""
    if claim is None:
        return None
    if not isinstance(claim, dict):
        raise AuthenticationError(
            "jwt-subject", "token's kubernetes.io claim is not shaped like a Kubernetes token's"
        )
    return claim.get(name)


def jwks_document(keys: Sequence[dict[str, Any]]) -> str:
    """A JWKS JSON document for the given JWK dicts (the dev issuer publishes one)."""
    return json.dumps({"keys": list(keys)}, indent=2, sort_keys=True)
