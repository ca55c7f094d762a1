"""Reaching into a wired-up `Agent` from tests: its scheduler, and its one identity's state."""

from __future__ import annotations

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
