"""The JWT authority driver's gate in-process, on a real key file: it asks the fleet only
when an activation is due, reads it once per poll, holds the activation while reports cannot
be read (saying so once), and activates once the agents hold the key. Time: the key file's
times are set so the activation is due now; nothing sleeps."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prometheus_client import CollectorRegistry

from ca_server.authority import Phase
from ca_server.fleet import FleetEntry, FleetReports
from ca_server.jwt_svid import (
    JwtAuthority,
    JwtKeyFactory,
    JwtKeyPolicy,
    JwtKeyState,
    LocalJwtKeyStore,
)
from ca_server.jwt_svid.keys import HISTORY_LIMIT, JwtEvent
from meshca.clock import FakeClock

LIFE = timedelta(hours=1)
FACTORY = JwtKeyFactory("ES256", LIFE)


def _due(state: JwtKeyState) -> JwtKeyState:
    now = datetime.now(UTC)
    born = now - timedelta(minutes=52)
    aged = dataclasses.replace(state.active, created_at=born, not_after=born + LIFE)
    prepared = FACTORY.new(now - timedelta(minutes=10), Phase.PREPARED)
    return JwtKeyState((aged, prepared), state.history)


def _fleet(*held: frozenset[str]) -> FleetReports:
    entries = {
        f"/default/web-{n}/u{n}": FleetEntry(
            f"/default/web-{n}/u{n}",
            "spiffe://td/ns/default/sa/web",
            None,
            None,
            frozenset(),
            None,
            0.0,
            kids,
        )
        for n, kids in enumerate(held)
    }
    return FleetReports(entries, frozenset())


def test_the_gate_reads_the_fleet_only_when_due_holds_on_unreadable_reports_then_activates(
    tmp_path: Path, caplog
):
    clock = FakeClock(datetime.now(UTC))
    store = LocalJwtKeyStore(tmp_path, FACTORY, clock)
    store.read()  # the first key
    answers: list[object] = []
    asked: list[datetime] = []

    def fleet(now: datetime) -> FleetReports:
        asked.append(now)
        answer = answers[0]
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, FleetReports)
        return answer

    policy = JwtKeyPolicy(lifetime=LIFE, max_token_ttl=timedelta(minutes=1))
    registry = CollectorRegistry()
    authority = JwtAuthority(
        store, FACTORY, policy, clock, poll_interval=60.0, fleet=fleet, registry=registry
    )

    def gauge() -> float | None:
        return registry.get_sample_value("meshca_ca_jwt_activation_gate_waiting")

    async def scenario() -> None:
        await authority.start()
        await authority.step()
        assert asked == []  # nothing prepared, nothing due: the fleet is not read
        store.transact(_due)
        prepared = store.read().prepared
        assert prepared is not None
        answers[:] = [OSError("the API server is away")]
        await authority.step()
        assert len(asked) == 1  # once, though the decision is made twice (before and in the lock)
        waiting = authority.state.gate_waiting()
        assert waiting is not None and "1 report(s) unreadable" in waiting.reason
        assert authority.state.active.kid != prepared.kid
        assert gauge() == 1
        await authority.step()  # still within the poll interval: the figure read is kept
        assert len(asked) == 1
        # The next poll reads again: one agent of two lacks the key, then both hold it.
        answers[:] = [_fleet(frozenset({prepared.kid}), frozenset({"other"}))]
        clock.advance(61)
        await authority.step()
        assert authority.state.active.kid != prepared.kid
        assert authority.coverage is not None
        assert authority.coverage.coverage.said("hold") == "1/2 reporting agents hold it"
        answers[:] = [_fleet(frozenset({prepared.kid}), frozenset({prepared.kid, "other"}))]
        clock.advance(61)
        await authority.step()
        assert authority.state.active.kid == prepared.kid
        assert gauge() == 0

    asyncio.run(scenario())
    warnings = [r for r in caplog.records if "cannot read the agents' reports" in r.message]
    assert len(warnings) == 1


def test_a_step_is_audited_when_the_history_is_full(tmp_path: Path, caplog):
    """The history keeps the last `HISTORY_LIMIT` events: a new one pushes the oldest out, and
    the process that applied it still writes its audit line."""
    clock = FakeClock(datetime.now(UTC))
    store = LocalJwtKeyStore(tmp_path, FACTORY, clock)
    first = store.read()
    old = tuple(
        JwtEvent(clock.now() - timedelta(days=n), "prepared", "x" * 43, "long ago")
        for n in range(HISTORY_LIMIT, 0, -1)
    )
    store.transact(lambda state: _due(JwtKeyState(state.keys, old)))
    prepared = store.read().prepared
    assert prepared is not None and first.active.kid != prepared.kid
    held = _fleet(frozenset({prepared.kid}))
    policy = JwtKeyPolicy(lifetime=LIFE, max_token_ttl=timedelta(minutes=1))
    authority = JwtAuthority(
        store, FACTORY, policy, clock, poll_interval=60.0, fleet=lambda now: held
    )

    async def scenario() -> None:
        await authority.start()
        caplog.set_level(logging.INFO, logger="meshca.audit")
        await authority.step()

    asyncio.run(scenario())
    assert store.read().active.kid == prepared.kid
    audited = [r.audit for r in caplog.records if getattr(r, "audit", None)]
    assert {(a["outcome"], a["kid"]) for a in audited} >= {("activated", prepared.kid)}
