"""The JWT-SVID authority every CA process runs: the shared keys, kept current on a clock.

`start()` reads the shared keys (the first process creates the first one, under the data
directory's lock); `run()` polls the store's fingerprint every `poll_interval` (noticing other
workers, replicas and `meshca authority … --jwt`) and applies `keys.scheduled_step` in a store
transaction, so a prepare or an activation happens once for the whole group, whichever process
gets there first. Between polls, every process signs with the same active key and publishes the
same JWKS — one key set for the trust domain, never one per replica.

Concurrency: `run()` is one coroutine on the CA's event loop; store reads and writes run in a
worker thread; `mint` and `jwks` run on the event loop and read the current state once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import timedelta

from ca_server.authority import Phase
from ca_server.jwt_svid.discovery import oidc_jwks_of
from ca_server.jwt_svid.keys import JwtKey, JwtKeyPolicy, JwtKeyState, scheduled_step
from ca_server.jwt_svid.minting import MintedToken, mint_jwt_svid
from ca_server.jwt_svid.store import JwtKeyFactory, JwtKeyStore
from certs import SpiffeId
from certs.jwk import jwks_document
from meshca.clock import Clock
from meshca.logs import audit

log = logging.getLogger(__name__)


class JwtAuthority:
    def __init__(
        self,
        store: JwtKeyStore,
        factory: JwtKeyFactory,
        policy: JwtKeyPolicy,
        clock: Clock,
        *,
        poll_interval: float,
        issuer: str | None = None,
        covered: Callable[[str], bool] = lambda kid: True,
    ) -> None:
        self._store = store
        self._factory = factory
        self.policy = policy
        self._clock = clock
        self._poll_interval = poll_interval
        self.issuer = issuer
        self._covered = covered
        self._state: JwtKeyState | None = None
        self._jwks = b""
        self._oidc_jwks = b""
        self._fingerprint = ""
        self.on_change: Callable[[JwtKeyState], None] = lambda state: None

    @property
    def state(self) -> JwtKeyState:
        if self._state is None:
            raise RuntimeError("the JWT authority has not started: await start() first")
        return self._state

    @property
    def jwks(self) -> bytes:
        """The trust domain's JWT bundle (every key in a slot), as published."""
        return self._jwks

    @property
    def oidc_jwks(self) -> bytes:
        """The same keys for OIDC relying parties (`discovery.oidc_jwks_of`)."""
        return self._oidc_jwks

    @property
    def max_age(self) -> timedelta:
        return self.policy.jwks_max_age

    def mint(self, identity: SpiffeId, audiences: tuple[str, ...]) -> MintedToken:
        return mint_jwt_svid(
            self.state.active,
            identity,
            audiences,
            self.policy.max_token_ttl,
            self._clock.now(),
            self.issuer,
        )

    def _adopt(self, state: JwtKeyState, fingerprint: str) -> None:
        changed = (
            self._state is None
            or self._state.published() != state.published()
            or (
                self._state.active.kid != state.active.kid
                or self._state.tainted_kids() != state.tainted_kids()
            )
        )
        self._state, self._fingerprint = state, fingerprint
        if changed:
            refresh = max(1, int(self.policy.jwks_max_age.total_seconds()))
            self._jwks = jwks_document(state.published(), refresh_hint=refresh)
            self._oidc_jwks = oidc_jwks_of(state)
            prepared = state.prepared
            log.info(
                "JWT-SVID keys: active %s (%s)%s, %d published",
                state.active.kid,
                state.active.algorithm,
                f", prepared {prepared.kid}" if prepared else "",
                len(state.keys),
            )
            self.on_change(state)

    async def start(self) -> None:
        state = await asyncio.to_thread(self._store.read)
        self._adopt(state, self._store.fingerprint())

    async def step(self) -> None:
        """One poll: reload if another writer changed the keys, then apply what is due."""
        fingerprint = await asyncio.to_thread(self._store.fingerprint)
        if fingerprint != self._fingerprint:
            state = await asyncio.to_thread(self._store.read)
            self._adopt(state, fingerprint)
        now = self._clock.now()
        due = scheduled_step(self.state, self.policy, now, self._new_key, self._covered)
        if due is None:
            return
        before = self.state.history
        state = await asyncio.to_thread(self._store.transact, self._scheduled)
        for event in state.history[len(before) :] if state.history[: len(before)] == before else ():
            audit("jwt-key", outcome=event.event, kid=event.kid, reason=event.reason)
        self._adopt(state, await asyncio.to_thread(self._store.fingerprint))

    def _new_key(self) -> JwtKey:
        return self._factory.new(self._clock.now(), Phase.PREPARED)

    def _scheduled(self, state: JwtKeyState) -> JwtKeyState | None:
        """The step, decided again inside the transaction on what is stored now."""
        return scheduled_step(state, self.policy, self._clock.now(), self._new_key, self._covered)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:
                log.exception("JWT-SVID key rotation step failed; retrying at the next poll")
            await self._clock.sleep(self._poll_interval)
