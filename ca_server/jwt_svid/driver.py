"""The JWT-SVID authority every CA process runs: the shared keys, kept current on a clock.

`start()` reads the shared keys (the first process creates the first one, under the data
directory's lock); `run()` polls the store's fingerprint every `poll_interval` (noticing other
workers, replicas and `meshca authority … --jwt`) and applies `keys.scheduled_step` in a store
transaction, so a prepare or an activation happens once for the whole group, whichever process
gets there first. Between polls, every process signs with the same active key and publishes the
same JWKS — one key set for the trust domain, never one per replica.

The activation gate's figure (`ca_server.fleet.jwt_coverage`) is read from every CA process's
agent reports (`fleet`: the authority driver's `agents`, the same merge the X.509 gate reads,
so workers and replicas count each other's agents) only while a prepared key exists: each poll
while its activation is due, else at most every `COVERAGE_REFRESH` for `coverage` (what
`meshca status` shows). Reports that cannot be read at all count as unreadable: the gate holds
until its deadline, as for the X.509 root.

Concurrency: `run()` is one coroutine on the CA's event loop; store reads and writes, and the
decision (which may read the fleet's reports or make a key), run in a worker thread; `mint`
and `jwks` run on the event loop and read the current state once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from prometheus_client import CollectorRegistry, Counter, Gauge

from ca_server.authority import GATE_DEADLINE_REASON, Phase
from ca_server.fleet import AgentCoverage, FleetReports, jwt_coverage
from ca_server.jwt_svid.discovery import oidc_jwks_of
from ca_server.jwt_svid.keys import (
    JwtKey,
    JwtKeyPolicy,
    JwtKeyState,
    no_reports,
    scheduled_step,
)
from ca_server.jwt_svid.minting import MintedToken, mint_jwt_svid
from ca_server.jwt_svid.store import JwtKeyFactory, JwtKeyStore
from certs import SpiffeId
from certs.jwk import jwks_document
from meshca.clock import Clock
from meshca.logs import audit

log = logging.getLogger(__name__)

COVERAGE_REFRESH = 30.0  # seconds between reads of the fleet for `coverage` alone
_MAX_STEPS_PER_POLL = 4  # a recovery is drop + prepare + activate


class JwtGateGauges:
    """The JWT key gate as metrics, named like the X.509 gate's."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.waiting = Gauge(
            "meshca_ca_jwt_activation_gate_waiting",
            "1 while a due JWT-SVID key activation waits for the agents to hold the key",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.deadline = Counter(
            "meshca_ca_jwt_activation_gate_deadline",
            "JWT-SVID key activations this CA process made at the gate's deadline, below the "
            "coverage --jwt-activate-at-coverage asked for",
            registry=registry,
        )


@dataclass(frozen=True)
class KeyCoverage:
    """The prepared key's coverage as last read, and when (what `meshca status` shows)."""

    kid: str
    coverage: AgentCoverage
    at: datetime

    def by_kid(self) -> dict[str, AgentCoverage]:
        return {self.kid: self.coverage}


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
        fleet: Callable[[datetime], FleetReports] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._store = store
        self._factory = factory
        self.policy = policy
        self._clock = clock
        self._poll_interval = poll_interval
        self.issuer = issuer
        self._fleet = fleet
        self._gauges = JwtGateGauges(registry) if registry is not None else None
        self._coverage_lock = threading.Lock()
        self._coverage_read = float("-inf")  # monotonic seconds of the last fleet read
        self.coverage: KeyCoverage | None = None  # the prepared key's, while there is one
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
        """One poll: reload if another writer changed the keys, then apply what is due (one
        step after another, so a recovery completes within the poll)."""
        fingerprint = await asyncio.to_thread(self._store.fingerprint)
        if fingerprint != self._fingerprint:
            state = await asyncio.to_thread(self._store.read)
            self._adopt(state, fingerprint)
        for _ in range(_MAX_STEPS_PER_POLL):
            if await asyncio.to_thread(self._scheduled, self.state) is None:
                break
            before = set(self.state.history)
            state = await asyncio.to_thread(self._store.transact, self._scheduled)
            # Not a slice past the old length: the history is capped (`keys.HISTORY_LIMIT`),
            # so once full a new event pushes the oldest out.
            for event in (e for e in state.history if e not in before):
                audit("jwt-key", outcome=event.event, kid=event.kid, reason=event.reason)
                self._tell(event.event, event.kid, event.reason)
                if self._gauges is not None and event.reason.startswith(GATE_DEADLINE_REASON):
                    self._gauges.deadline.inc()
            self._adopt(state, await asyncio.to_thread(self._store.fingerprint))
        if self._gauges is not None:
            self._gauges.waiting.set(1 if self.state.gate_waiting() is not None else 0)
        if self.state.prepared is None:
            self.coverage = None
        elif self._clock.monotonic() - self._coverage_read >= COVERAGE_REFRESH:
            await asyncio.to_thread(self._coverage_of, self.state.prepared.kid)

    @staticmethod
    def _tell(event: str, kid: str, reason: str) -> None:
        """Says loudly what the operator should look into: an activation the gate gave up
        waiting for, or one forced by an active key that could no longer sign."""
        if event == "activated" and (
            reason.startswith(GATE_DEADLINE_REASON) or "activated at once" in reason
        ):
            log.warning("JWT-SVID key %s activated: %s", kid, reason)
        elif event in ("activation-gated", "prepared", "activated"):
            log.info("JWT-SVID key %s %s: %s", kid, event, reason)

    def _new_key(self) -> JwtKey:
        return self._factory.new(self._clock.now(), Phase.PREPARED)

    def _scheduled(self, state: JwtKeyState) -> JwtKeyState | None:
        """The step due on `state` (blocking: a worker thread); decided again inside the
        transaction on what is stored then."""
        return scheduled_step(
            state, self.policy, self._clock.now(), self._new_key, self._coverage_of
        )

    def _coverage_of(self, kid: str) -> AgentCoverage:
        """The gate's figure for `kid`, from every CA process's reports (blocking), read at
        most once per poll interval (the decision asks twice: before and in the transaction)."""
        if self._fleet is None:
            return no_reports(kid)
        with self._coverage_lock:
            known = self.coverage
            fresh = self._clock.monotonic() - self._coverage_read < self._poll_interval
            if known is not None and known.kid == kid and fresh:
                return known.coverage
            now = self._clock.now()
            try:
                counted = jwt_coverage(kid, self._fleet(now))
            except Exception as exc:  # an API or file failure: nobody knows who holds it
                if self.coverage is None or not self.coverage.coverage.unreadable:
                    log.warning("cannot read the agents' reports for the JWT key gate: %s", exc)
                counted = AgentCoverage(0, 0, unreadable=1)
            self.coverage = KeyCoverage(kid, counted, now)
            self._coverage_read = self._clock.monotonic()
            return counted

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:
                log.exception("JWT-SVID key rotation step failed; retrying at the next poll")
            await self._clock.sleep(self._poll_interval)
