"""A two-pod mesh on one CA, for end-to-end tests: one `meshca agent` per pod (through the CLI)
and two real Envoys doing mTLS with each other, each taking `default` and `ROOTCA` over SDS from
its own agent and pinning its peer's SPIFFE ID.

The CA is the caller's (each test starts it with the flags it is about); `start_mesh` registers
every process's stop with `cleanup` before starting it, so a failure half-way still stops
everything (pytest finalizers run in reverse order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.agent_process import AgentProcess
from tests.support.ca_process import CaProcess
from tests.support.envoy import EnvoyPair, EnvoyProcess, http_get, start_envoy_pair
from tests.support.processes import wait_for

CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/default/sa/server"


@dataclass
class Mesh:
    workdir: Path
    ca: CaProcess
    client: AgentProcess
    server: AgentProcess
    envoys: EnvoyPair

    @property
    def agents(self) -> dict[str, AgentProcess]:
        return {"client": self.client, "server": self.server}

    @property
    def envoy_of(self) -> dict[str, EnvoyProcess]:
        return {"client": self.envoys.client, "server": self.envoys.server}

    def pids(self) -> dict[str, int]:
        """Every agent's and Envoy's process id: equal before and after means no restart."""
        procs = {f"agent {n}": a.proc for n, a in self.agents.items()}
        procs |= {f"envoy {n}": e.proc for n, e in self.envoy_of.items()}
        pids = {}
        for name, proc in procs.items():
            assert proc is not None and proc.poll() is None, f"{name} is not running"
            pids[name] = proc.pid
        return pids


def start_mesh(
    workdir: Path,
    ca: CaProcess,
    cleanup: Callable[[Callable[[], object]], object],
    *,
    secret_ttl: str,
    agent_args: tuple[str, ...] = (),
) -> Mesh:
    """Two agents (`client`, `server`) on `ca` and their Envoys; returns once a first request
    has passed through mTLS. `agent_args` are extra `meshca agent` flags for both agents
    (e.g. the report interval and taint window a test is about)."""
    client = AgentProcess(workdir, ca, "client", secret_ttl=secret_ttl, extra_args=agent_args)
    server = AgentProcess(workdir, ca, "server", secret_ttl=secret_ttl, extra_args=agent_args)
    for agent in (client, server):
        cleanup(agent.stop)
        agent.launch()
    for agent in (client, server):
        agent.wait_ready()
    assert (client.identity, server.identity) == (CLIENT_ID, SERVER_ID)
    envoys = start_envoy_pair(
        workdir,
        client_sds_socket=client.sds_socket,
        server_sds_socket=server.sds_socket,
        client_identity=CLIENT_ID,
        server_identity=SERVER_ID,
    )
    cleanup(envoys.stop)
    wait_for(lambda: http_get(envoys.url).ok, 10, "a first request through mTLS")
    return Mesh(workdir, ca, client, server, envoys)
