"""Reaching into a wired-up `Agent` from tests: its scheduler, and its one identity's state;
and waiting on the loop for a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from agent.certificate_source import CaCertificateSource
from agent.main import Agent
from agent.scheduler import CertificateScheduler, IdentityState


def scheduler_of(agent: Agent) -> CertificateScheduler:
    """The scheduler behind a CA-backed agent (fails the test for a file-mounted one)."""
    source = agent.certificates
    assert isinstance(source, CaCertificateSource), f"not CA-backed: {source!r}"
    return source.scheduler


def pod_state(agent: Agent) -> IdentityState | None:
    """A pod agent's one identity, once its source has reported it."""
    states = list(scheduler_of(agent).states.values())
    assert len(states) <= 1, "a pod agent serves one identity"
    return states[0] if states else None


def pod_generation(agent: Agent) -> int:
    """How many certificates the pod agent has installed so far."""
    state = pod_state(agent)
    return state.generation if state else 0


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Lets the loop run (key generation uses a real thread) until `predicate` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
