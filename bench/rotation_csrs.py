"""How many CSRs a whole CA rotation costs: a rotating CA against a steady one, same agents.

Run: `.venv/bin/python -m bench.rotation_csrs [--agents 5] [--root-ttl 48] [--leaf-ttl 6]`

Two real `meshca ca` processes side by side, each with `--agents` real `meshca agent`
processes (pod mode, through the CLI, `--ca-root` the CA's `root-cert.pem`) asking for
`--leaf-ttl` leaves:

- rotating: a self-signed root of `--root-ttl` seconds, so within the run the CA prepares a new
  authority (the bundle grows), activates it and drops the old one (the bundle shrinks);
- steady: `--no-root-rotation`, the same leaf TTL: the CSRs agents send when nothing but their
  leaves' age moves them — the baseline, measured over the same seconds on the same machine.

Both CAs' `issued` audit lines are counted from the moment every agent holds a leaf until the
old authority is dropped, and split per agent (`tests.support.csr_audit`) into due renewals and
early ones (sent while the previous leaf was young: what a bundle change would cause if agents
re-signed on it). Printed: CSRs per CA, per agent, rotating/steady ratio, and what re-signing
on every bundle change (Istio's behaviour) would have added: agents x bundle changes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.support.agent_process import AgentProcess
from tests.support.ca_process import CaProcess
from tests.support.csr_audit import CsrTally, issued_lines, tally
from tests.support.processes import wait_for

BUNDLE_EVENTS = ("authority-prepared", "authority-dropped", "authority-revoked")


def audit_events(ca: CaProcess, names: tuple[str, ...]) -> list[dict[str, object]]:
    events = []
    for line in ca.log().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("msg") in names:
                events.append(record)
    return events


def tallies(ca: CaProcess, since: datetime, until: datetime) -> dict[str, CsrTally]:
    issued = [item for item in issued_lines(ca.log()) if item.at <= until]
    return tally(issued, since)


def row(label: str, entries: dict[str, CsrTally], agents: int) -> tuple[str, int, int, int]:
    total = sum(e.total for e in entries.values())
    due = sum(e.due for e in entries.values())
    early = sum(len(e.early) for e in entries.values())
    print(
        f"  {label:<26} {total:>5} CSRs  {due:>5} due renewals  {early:>3} early  "
        f"{total / agents:6.2f} per agent  {early / agents:5.2f} early per agent"
    )
    return label, total, due, early


def run(workdir: Path, agents: int, root_ttl: int, leaf_ttl: int) -> None:
    rotating = CaProcess(
        workdir / "rot", "--root-ttl", f"{root_ttl}s", "--ca-reload-interval", "1s"
    )
    steady = CaProcess(workdir / "std", "--no-root-rotation", "--ca-reload-interval", "1s")
    started: list[AgentProcess | CaProcess] = []
    try:
        for ca in (rotating, steady):
            started.append(ca)
            ca.launch()
        for ca in (rotating, steady):
            ca.wait_ready()
        pods = []
        for ca, tag in ((rotating, "r"), (steady, "s")):
            for i in range(agents):
                agent = AgentProcess(workdir / tag, ca, f"app{i}", secret_ttl=f"{leaf_ttl}s")
                started.append(agent)
                agent.launch()
                pods.append(agent)
        for agent in pods:
            agent.wait_ready(120)
        since = datetime.now(UTC)
        print(f"{2 * agents} agents ready; waiting for the rotating CA's old authority to go")
        wait_for(
            lambda: bool(audit_events(rotating, ("authority-dropped",))),
            root_ttl * 2 + 30,
            "the first authority dropped",
            interval=0.5,
        )
        time.sleep(2)  # the agents' last learns and any CSR they would send for it
        until = datetime.now(UTC)
        for agent in pods:
            assert agent.running, f"agent {agent.service_account} exited:\n{agent.log()}"
        changes = [
            e for e in audit_events(rotating, BUNDLE_EVENTS) if str(e["ts"]) >= since.isoformat()
        ]
        if not changes or changes[0]["msg"] != "authority-prepared":
            raise SystemExit(
                "the agents were ready only after the rotation had begun: the count would miss "
                "part of the cycle; run with a longer --root-ttl"
            )
        seconds = (until - since).total_seconds()
        print(
            f"\nrotation_csrs: {agents} agents per CA, leaves {leaf_ttl} s, root {root_ttl} s; "
            f"{seconds:.0f} s counted, {len(changes)} bundle changes on the rotating CA "
            f"({', '.join(str(e['msg']).removeprefix('authority-') for e in changes)})"
        )
        _, steady_total, _, _ = row("steady CA (baseline)", tallies(steady, since, until), agents)
        _, rot_total, _, rot_early = row(
            "rotating CA (whole cycle)", tallies(rotating, since, until), agents
        )
        print(
            f"  rotating / steady CSRs: {rot_total / max(steady_total, 1):.2f}x; "
            f"beyond due renewals: {rot_early} ({rot_early / agents:.2f} per agent, goal <= 1)"
        )
        print(
            f"  re-signing on every bundle change (Istio's way) would have added "
            f"{agents} x {len(changes)} = {agents * len(changes)} CSRs "
            f"({(rot_total + agents * len(changes)) / max(rot_total, 1):.2f}x)"
        )
    finally:
        for process in reversed(started):
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=5, help="agents per CA")
    parser.add_argument("--root-ttl", type=int, default=48, help="rotating root, seconds")
    parser.add_argument("--leaf-ttl", type=int, default=6, help="leaf TTL asked, seconds")
    args = parser.parse_args()
    if args.leaf_ttl > args.root_ttl / 6:
        parser.error("--leaf-ttl must be at most --root-ttl / 6 (the CA caps leaves there)")
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rcsr-") as tmp:
        run(Path(tmp), args.agents, args.root_ttl, args.leaf_ttl)


if __name__ == "__main__":
    main()
