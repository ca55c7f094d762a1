"""Reaching into a wired-up `Agent` from tests: its scheduler, and its one identity's state;
waiting on the loop for a condition; the configuration of a node agent against a fake CA."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from agent.certificate_source import CaCertificateSource
from agent.config import AgentConfig
from agent.main import Agent
from agent.scheduler import CertificateScheduler, IdentityState


def node_agent_config(
    directory: Path, ca_addr: str, identities: tuple[tuple[str, str], ...]
) -> AgentConfig:
    """A node agent serving the static `identities` (no API server) from the CA at `ca_addr`,
    with its token, root file (`start_fake_ca` writes it), socket and files in `directory`."""
    return AgentConfig(
        ca_addr=ca_addr,
        ca_root_ca=directory / "root-cert.pem",
        token_path=directory / "token",
        sds_socket=directory / "sds" / "socket",
        output_certs=directory / "certs",
        status_port=0,
        node_mode=True,
        node_name="node-1",
        identities=identities,
    )


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
