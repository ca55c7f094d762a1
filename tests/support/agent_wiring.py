"""Reaching into a wired-up `Agent` from tests: its scheduler, and its one identity's state;
waiting on the loop for a condition; moving fake time in steps the scheduler keeps up with;
the configuration of a node agent against a fake CA."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from agent.certificate_source import CaCertificateSource
from agent.config import AgentConfig
from agent.main import Agent
from agent.scheduler import CertificateScheduler
from agent.scheduler_state import IdentityState
from meshca.clock import FakeClock


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


def settled(scheduler: CertificateScheduler, now: datetime) -> bool:
    """Nothing due by `now` is left to do: every identity waits on a timer set for later, so none
    is past its deadline with its timer not yet run, queued, being signed or being installed."""
    return all(s.due_at is not None and s.due_at > now for s in list(scheduler.states.values()))


async def advance_settled(
    clock: FakeClock, scheduler: CertificateScheduler, seconds: float, step: float = 1.0
) -> None:
    """Moves `clock` on by `seconds` in `step`s and, after each, lets the loop run until the
    scheduler has `settled`: whatever fell due is signed and installed at the fake time it fell
    due. Advancing without waiting races the fake clock against real work (key generation runs
    in a thread): the clock runs ahead by as many steps as loop turns the thread takes, and
    the signer sees the late fake time — more of them the busier the machine."""
    moved = 0.0
    while moved < seconds:
        delta = min(step, seconds - moved)
        clock.advance(delta)
        moved += delta
        await until(lambda: settled(scheduler, clock.now()))
