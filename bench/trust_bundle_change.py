"""What a trust bundle change costs a node agent: meshca's push versus re-minting every leaf.

Run: `.venv/bin/python -m bench.trust_bundle_change [--identities 200]`

A node agent (the wired-up `agent.main.Agent`, static identities, files in `--output-dir`)
against an in-process TLS gRPC CA that counts every CSR. In one run it measures:

- baseline, Istio's way: every identity re-signs (what a bundle change costs an Istio proxy):
  time until every identity holds a new leaf, and the CSRs the CA received;
- meshca: the root file is replaced with old + new root: time until `ROOTCA` and every
  identity's `root-cert.pem` hold both, and the CSRs the CA received (expected: 0);

and prints both with their ratio, so the figures compare within one run on a noisy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from agent.main import Agent
from agent.secrets import RootSecret
from agent.trust_bundle import root_fingerprint
from certs import load_certs
from meshca.clock import SystemClock
from tests.support.agent_wiring import node_agent_config, scheduler_of
from tests.support.fake_ca import NODE_TOKEN, node_ca, start_fake_ca
from tests.support.pki import TestCa


def roots_in(pem: str | bytes) -> set[bytes]:
    return {root_fingerprint(cert) for cert in load_certs(pem)}


async def wait(predicate: Callable[[], bool], timeout: float) -> float:
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.002)
    return time.perf_counter() - started


async def run(tmp: Path, count: int) -> None:
    clock = SystemClock()
    pki = TestCa(datetime.now(UTC))
    ca = node_ca(pki, clock, delay=0)
    server, addr = await start_fake_ca(ca, tmp, clock.now())
    (tmp / "token").write_text(NODE_TOKEN)
    pairs = tuple((f"ns{i % 10}", f"sa{i}") for i in range(count))
    config = node_agent_config(tmp, addr, pairs)
    agent = Agent(config, clock=clock)
    await agent.start()
    try:
        scheduler = scheduler_of(agent)
        await wait(lambda: scheduler.has_valid_certificate(), 300)
        print(f"node agent serving {count} identities")

        # Baseline: re-mint every leaf.
        before = sum(ca.issued.values())
        generations = {s.identity: s.generation for s in scheduler.states.values()}
        scheduler.request_rotation()
        remint = await wait(
            lambda: all(s.generation > generations[s.identity] for s in scheduler.states.values()),
            600,
        )
        remint_csrs = sum(ca.issued.values()) - before

        # meshca: the bundle changes, nothing is re-minted.
        before = sum(ca.issued.values())
        new_root = TestCa(datetime.now(UTC)).root_pem
        both_pem = pki.root_pem + new_root
        both = roots_in(both_pem)
        files = [tmp / "certs" / ns / sa / "root-cert.pem" for ns, sa in pairs]
        (tmp / "root-cert.pem.new").write_text(both_pem)
        os.replace(tmp / "root-cert.pem.new", tmp / "root-cert.pem")

        def pushed() -> bool:
            served = agent.cache.get("ROOTCA")
            if not isinstance(served, RootSecret) or roots_in(served.trusted_ca_pem) != both:
                return False
            return all(roots_in(path.read_bytes()) == both for path in files)

        push = await wait(pushed, 120)
        await asyncio.sleep(1.0)  # anything a bundle change would trigger has had time to start
        push_csrs = sum(ca.issued.values()) - before

        print(f"{'':38}{'seconds':>10}{'CSRs':>8}")
        print(f"{'baseline: re-mint every leaf (Istio)':38}{remint:>10.3f}{remint_csrs:>8}")
        print(f"{'meshca: push the bundle (SDS + files)':38}{push:>10.3f}{push_csrs:>8}")
        ratio = push / remint
        print(f"ratio (meshca / baseline): time {ratio:.3f}, CSRs {push_csrs}/{remint_csrs}")
    finally:
        await agent.stop()
        await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mtb-") as tmp:
        asyncio.run(run(Path(tmp), args.identities))


if __name__ == "__main__":
    main()
