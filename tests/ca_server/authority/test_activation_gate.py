"""`--activate-at-coverage`, the pure part: at the 5/6 point a gated activation waits (one
`activation-gated` event, which `show` reads) until enough reporting agents trust the prepared
authority, and activates anyway at the deadline with a reason that says so."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ca_server.authority.self_signed import rotation_policy_for
from ca_server.authority.slots import (
    GATE_DEADLINE_REASON,
    GATE_WAITING,
    AuthorityState,
    Phase,
    SlotRotationPolicy,
    gate_waiting,
    scheduled_step,
)
from ca_server.authority.state_store import SlotFactory
from ca_server.config import CaConfig, ConfigError
from ca_server.fleet.coverage import AgentCoverage
from certs import KeySpec
from meshca.cli import build_parser

START = datetime(2030, 1, 1, tzinfo=UTC)
LIFE = timedelta(minutes=60)  # prepared at 30 min, due at 50 min; lead 10 min
GATED = SlotRotationPolicy(lifetime=LIFE, activate_at_coverage=0.9, activate_deadline=0.5)
FACTORY = SlotFactory(KeySpec(), "cluster.local", LIFE)


def _prepared() -> AuthorityState:
    at = START + timedelta(minutes=30)
    state = scheduled_step(
        FACTORY.first_state(START), GATED, at, lambda: FACTORY.new(at, Phase.PREPARED)
    )
    assert state is not None and state.prepared is not None
    return state


def _step(state: AuthorityState, minutes: float, covered: AgentCoverage) -> AuthorityState | None:
    at = START + timedelta(minutes=minutes)
    asked: list[str] = []

    def coverage_of(ident: str) -> AgentCoverage:
        asked.append(ident)
        return covered

    result = scheduled_step(
        state, GATED, at, lambda: FACTORY.new(at, Phase.PREPARED), coverage_of=coverage_of
    )
    assert asked in ([], [state.prepared.id if state.prepared else ""])
    return result


def test_waits_below_the_coverage_then_activates_once_reached() -> None:
    state = _prepared()
    prepared = state.prepared
    assert prepared is not None
    assert _step(state, 49, AgentCoverage(0, 10)) is None  # not due yet: not even asked

    held = _step(state, 50, AgentCoverage(7, 10))
    assert held is not None and held.prepared == prepared  # still prepared
    event = gate_waiting(held)
    assert event is not None and event.event == GATE_WAITING and event.authority == prepared.id
    assert "90%" in event.reason and "activates anyway at 2030-01-01T00:55:00" in event.reason
    assert _step(held, 51, AgentCoverage(8, 10)) is None  # waiting: one event, not one a poll

    done = _step(held, 52, AgentCoverage(9, 10))
    assert done is not None and done.active.id == prepared.id
    assert gate_waiting(done) is None
    assert "9/10 reporting agents trust it" in done.history[-2].reason


def test_activates_anyway_at_the_deadline_and_says_so() -> None:
    held = _step(_prepared(), 50, AgentCoverage(7, 10))
    assert held is not None
    assert _step(held, 54.9, AgentCoverage(7, 10)) is None
    done = _step(held, 55, AgentCoverage(7, 10))  # half the 10 min lead past the 5/6 point
    assert done is not None and done.prepared is None
    activated = next(e for e in reversed(done.history) if e.event == "activated")
    assert activated.reason.startswith(GATE_DEADLINE_REASON)
    assert "7/10" in activated.reason and "90%" in activated.reason


def test_no_reporting_agent_strands_nobody() -> None:
    done = _step(_prepared(), 50, AgentCoverage(0, 0))
    assert done is not None and done.prepared is None
    assert "no agent reports" in done.history[-2].reason


def test_without_the_gate_the_clock_alone_activates() -> None:
    ungated = SlotRotationPolicy(lifetime=LIFE)
    at = START + timedelta(minutes=50)
    state = scheduled_step(
        _prepared(), ungated, at, lambda: FACTORY.new(at, Phase.PREPARED),
        coverage_of=lambda _ident: pytest.fail("coverage asked without a gate"),
    )  # fmt: skip
    assert state is not None and state.prepared is None


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="coverage"):
        SlotRotationPolicy(lifetime=LIFE, activate_at_coverage=1.5)
    with pytest.raises(ValueError, match="deadline"):
        SlotRotationPolicy(lifetime=LIFE, activate_deadline=1.0)


def _ca_config(*args: str) -> CaConfig:
    parsed = build_parser("ca").parse_args(["ca", "--data-dir", "/tmp/d", *args])
    return CaConfig.from_args(parsed, {})


def test_flags_reach_the_rotation_policy_and_nonsense_is_refused() -> None:
    config = _ca_config("--activate-at-coverage", "0.95", "--activate-deadline", "0.25")
    policy = rotation_policy_for(config)
    assert policy.activate_at_coverage == 0.95 and policy.activate_deadline == 0.25
    assert rotation_policy_for(_ca_config()).activate_at_coverage is None  # by the clock
    for args, message in (
        (("--activate-at-coverage", "0"), "--activate-at-coverage"),
        (("--activate-at-coverage", "95"), "fraction"),
        (("--activate-at-coverage", "0.9", "--activate-deadline", "1"), "--activate-deadline"),
        (("--activate-at-coverage", "0.9", "--no-root-rotation"), "needs --root-rotation"),
    ):
        with pytest.raises(ConfigError, match=message):
            _ca_config(*args)
