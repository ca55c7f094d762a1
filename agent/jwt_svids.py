"""JWT-SVIDs for the workloads the agent serves: tokens from the CA, cached; the JWT bundle,
kept current; and validation against it (the Workload API's JWT profile, `agent.workload`).

- Tokens: the CA signs them (`meshca.v1.JwtSvidService/MintJwtSvid`, the agent's own
  credentials; in node mode naming the attested pod's identity, which the CA's node authorizer
  checks). Each is cached per (identity, audience set) until half its life is gone, so a
  workload asking 1,000 times a second costs the CA one signature per audience set per half
  life; concurrent asks for the same entry share one CA call. A token whose key was tainted,
  or left the bundle, is dropped at once. The cache holds at most `max_cached` entries (the
  oldest first out).
- The bundle: fetched from the CA every `poll_interval` (`FetchJwtBundle`, default 15 s) and
  handed to every `FetchJWTBundles` stream when it changes — only once a workload has made a JWT
  call: an agent whose workloads never use JWT-SVIDs costs the CA nothing (a fleet of 150,000
  sidecars polling every few seconds would be tens of thousands of RPCs a second). The CA
  publishes a key `--jwks-max-age` (default 5 min) before it signs, far beyond one poll.
- Validation (`validate_jwt_svid`): the token's `kid` must name a key of the bundle, its `alg`
  must be that key's own (so `none`, HMAC and any algorithm swap find nothing to verify with),
  the signature must verify, `aud` must hold the audience asked for, `exp` must be in the future
  on the agent's clock, and `sub` must be a SPIFFE ID of the trust domain.

Concurrency: one asyncio loop (the agent's); the poll is one task, started by the first JWT
call and ended by `close()`.
Tokens never reach a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from agent.errors import CaClientError
from certs import CertsError, SpiffeId
from meshca.clock import Clock
from meshca.wire import MAX_JWT_KID, MAX_REPORTED_JWT_KIDS
from meshca_proto import jwt_svid_pb2

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 15.0
DEFAULT_MAX_CACHED = 4096
SIGNING_ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "PS384",
                      "PS512")  # fmt: skip  # the JWT-SVID specification's list


class JwtCa(Protocol):
    """The part of `agent.ca_client.CaClient` JWT-SVIDs need."""

    async def mint_jwt_svid(
        self, audiences: Sequence[str], impersonate: SpiffeId | None
    ) -> jwt_svid_pb2.MintJwtSvidResponse: ...

    async def fetch_jwt_bundle(self) -> jwt_svid_pb2.JwtBundleResponse: ...


class InvalidJwtSvid(Exception):
    """A token that does not validate; the message says which check it failed."""


@dataclass(frozen=True)
class JwtToken:
    token: str = field(repr=False)
    spiffe_id: str
    kid: str
    issued_at: datetime
    expires_at: datetime

    def fresh(self, now: datetime) -> bool:
        """Served from the cache until half its life is gone."""
        return now < self.issued_at + (self.expires_at - self.issued_at) / 2


@dataclass(frozen=True)
class JwtBundle:
    trust_domain_id: str
    jwks: bytes
    keys: dict[str, dict[str, Any]]  # kid -> JWK
    tainted: frozenset[str]

    @classmethod
    def parse(cls, answer: jwt_svid_pb2.JwtBundleResponse) -> JwtBundle:
        document = json.loads(answer.jwks)
        keys = {str(k["kid"]): dict(k) for k in document.get("keys", ()) if "kid" in k}
        return cls(answer.trust_domain_id, bytes(answer.jwks), keys, frozenset(answer.tainted_kids))


def _kid_of(token: str) -> str:
    import jwt  # here: a sidecar that never serves a JWT-SVID never loads pyjwt

    try:
        return str(jwt.get_unverified_header(token).get("kid", ""))
    except jwt.PyJWTError:
        return ""


class JwtSvidSource:
    def __init__(
        self,
        ca: JwtCa,
        clock: Clock,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        max_cached: int = DEFAULT_MAX_CACHED,
    ) -> None:
        self._ca = ca
        self._clock = clock
        self._poll_interval = poll_interval
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, tuple[str, ...]], JwtToken] = OrderedDict()
        self._pending: dict[tuple[str, tuple[str, ...]], asyncio.Future[JwtToken]] = {}
        self._bundle: JwtBundle | None = None
        self._changed = asyncio.Condition()
        self._polling: asyncio.Task[None] | None = None
        self.minted = 0  # CA calls that returned a token (what `meshca status` shows)

    @property
    def bundle(self) -> JwtBundle | None:
        return self._bundle

    def held_kids(self) -> tuple[str, ...]:
        """What the periodic report tells the CA (`agent.reporter`): the kids of the bundle
        held, in its order (the CA lists the active and prepared keys first), at most
        `MAX_REPORTED_JWT_KIDS`; none before the first JWT call (no bundle held: the first call
        fetches the current one, so nothing here can be stale)."""
        if self._bundle is None:
            return ()
        kids = (kid for kid in self._bundle.keys if len(kid) <= MAX_JWT_KID)
        return tuple(kids)[:MAX_REPORTED_JWT_KIDS]

    def _poll(self) -> None:
        """Starts the bundle poll at the first JWT call (it also drops tainted tokens)."""
        if self._polling is None:
            self._polling = asyncio.create_task(self.run(), name="jwt-bundle-poll")

    async def close(self) -> None:
        task, self._polling = self._polling, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def fetch(self, identity: SpiffeId | None, audiences: Sequence[str]) -> JwtToken:
        """A token for `identity` (None: the agent's own, pod mode) and `audiences`, from the
        cache while fresh. Raises `CaClientError` (the CA refused or is unreachable)."""
        self._poll()
        key = (identity.uri if identity else "", tuple(sorted(set(audiences))))
        cached = self._cache.get(key)
        if cached is not None and cached.fresh(self._clock.now()):
            return cached
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[JwtToken] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            token = await self._mint(identity, audiences)
            future.set_result(token)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lone caller's failure is not "never retrieved"
            raise
        finally:
            del self._pending[key]
        self._cache[key] = token
        self._cache.move_to_end(key)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return token

    async def _mint(self, identity: SpiffeId | None, audiences: Sequence[str]) -> JwtToken:
        answer = await self._ca.mint_jwt_svid(list(audiences), identity)
        self.minted += 1
        return JwtToken(
            answer.token,
            answer.spiffe_id,
            _kid_of(answer.token),
            datetime.fromtimestamp(answer.issued_at, UTC),
            datetime.fromtimestamp(answer.expires_at, UTC),
        )

    def adopt(self, bundle: JwtBundle) -> bool:
        """Takes a bundle from the CA; drops cached tokens whose key was tainted or is gone.
        Returns whether anything a stream shows changed."""
        current = self._bundle
        if current is not None and (current.jwks, current.tainted) == (
            bundle.jwks,
            bundle.tainted,
        ):
            return False
        self._bundle = bundle
        stale = [
            k for k, t in self._cache.items() if t.kid in bundle.tainted or t.kid not in bundle.keys
        ]
        for key in stale:
            del self._cache[key]
        if stale:
            log.info("dropped %d cached JWT-SVIDs signed by tainted or retired keys", len(stale))
        return current is None or current.jwks != bundle.jwks

    async def refresh(self) -> None:
        """One poll of the CA's bundle; streams are woken when it changed."""
        bundle = JwtBundle.parse(await self._ca.fetch_jwt_bundle())
        if self.adopt(bundle):
            async with self._changed:
                self._changed.notify_all()

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except (CaClientError, ValueError, KeyError) as exc:
                log.warning("could not refresh the JWT bundle from the CA: %s", exc)
            await self._clock.sleep(self._poll_interval)

    async def bundles(self) -> AsyncIterator[JwtBundle]:
        """The bundle once known, then each changed one."""
        self._poll()
        seen: list[bytes] = []  # the last one yielded

        def news() -> bool:
            return self._bundle is not None and (not seen or self._bundle.jwks != seen[-1])

        while True:
            async with self._changed:
                await self._changed.wait_for(news)
                bundle = self._bundle
            assert bundle is not None
            seen[:] = [bundle.jwks]
            yield bundle

    async def validate(self, token: str, audience: str) -> tuple[str, dict[str, Any]]:
        """Against the current bundle (fetched first if this is the agent's first JWT call)."""
        self._poll()
        if self._bundle is None:
            try:
                await self.refresh()
            except (CaClientError, ValueError, KeyError) as exc:
                raise InvalidJwtSvid(f"the agent has no JWT bundle yet: {exc}") from None
        assert self._bundle is not None
        return validate_jwt_svid(token, audience, self._bundle, self._clock.now())


def validate_jwt_svid(
    token: str, audience: str, bundle: JwtBundle, now: datetime
) -> tuple[str, dict[str, Any]]:
    """(SPIFFE ID, claims) of a token that passes every check in the module docstring; raises
    `InvalidJwtSvid` naming the failed check otherwise."""
    import jwt  # here: a sidecar that never validates a JWT-SVID never loads pyjwt

    if not audience:
        raise InvalidJwtSvid("audience is required")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise InvalidJwtSvid(f"not a JWT: {exc}") from None
    kid, alg = header.get("kid"), header.get("alg")
    if alg not in SIGNING_ALGORITHMS:
        raise InvalidJwtSvid(f"algorithm {alg!r} is not allowed for JWT-SVIDs")
    jwk = bundle.keys.get(str(kid)) if isinstance(kid, str) else None
    if jwk is None:
        raise InvalidJwtSvid(f"no key {kid!r} in the trust domain's JWT bundle")
    if jwk.get("alg") and jwk["alg"] != alg:
        raise InvalidJwtSvid(f"key {kid} signs with {jwk['alg']}, the token says {alg}")
    try:
        key = jwt.PyJWK(jwk, algorithm=alg).key
        claims: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=[alg],
            audience=audience,
            options={"require": ["sub", "aud", "exp"], "verify_exp": False},
        )
    except jwt.PyJWTError as exc:
        raise InvalidJwtSvid(f"token refused: {exc}") from None
    if not isinstance(claims["exp"], int | float) or now.timestamp() >= claims["exp"]:
        raise InvalidJwtSvid("token has expired")
    try:
        subject = SpiffeId.parse(str(claims["sub"]))
    except CertsError as exc:
        raise InvalidJwtSvid(f"sub: {exc}") from None
    if f"spiffe://{subject.trust_domain}" != bundle.trust_domain_id:
        raise InvalidJwtSvid(f"sub {subject.uri} is not in {bundle.trust_domain_id}")
    return subject.uri, claims
