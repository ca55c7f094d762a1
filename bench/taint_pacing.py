"""What re-signing after a taint costs the CA: meshca's paced re-sign versus everybody at once.

Run: `.venv/bin/python -m bench.taint_pacing [--identities 300] [--window 30]`

A node agent (the wired-up `agent.main.Agent`, static identities) against an in-process TLS
gRPC CA that timestamps every CSR. In one run it measures:

- baseline, every identity re-signs at once (what a bundle or authority change costs an Istio
  proxy fleet, and what an unpaced taint would): the peak CSRs the CA receives in any one
  second, and the time until every identity holds a new leaf;
- meshca: the scheduler is told the leaves' authority is tainted (what the periodic report's
  answer does, `CertificateScheduler.taints_learned`) with `--taint-resign-window`:
  the same two figures, and the expected peak (identities / window);

and prints both with their ratio. Each identity sends exactly one CSR in either case.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from agent.main import Agent
from agent.propagation import leaf_authority
from agent.taints import SOURCE_REPORT
from certs import SpiffeId
from meshca.clock import SystemClock
from meshca.logs import configure_logging
from meshca_proto import ca_pb2
from tests.support.agent_wiring import node_agent_config, scheduler_of
from tests.support.fake_ca import NODE_TOKEN, FakeCaServicer, start_fake_ca
from tests.support.pki import TestCa


class TimestampingCa(FakeCaServicer):
    """The test CA, noting when each CSR arrives (monotonic seconds)."""

    def __init__(self, pki: TestCa) -> None:
        super().__init__(pki, SystemClock(), node_agent=True, token=NODE_TOKEN)
        self.arrivals: list[float] = []

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        self.arrivals.append(time.monotonic())
        return await super().CreateCertificate(request, context)


def peak_per_second(arrivals: list[float]) -> int:
    """The most arrivals in any one-second span."""
    arrivals = sorted(arrivals)
    best, start = 0, 0
    for end, at in enumerate(arrivals):
        while at - arrivals[start] >= 1.0:
            start += 1
        best = max(best, end - start + 1)
    return best


async def wait(predicate: Callable[[], bool], timeout: float) -> float:
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)
    return time.perf_counter() - started


async def run(tmp: Path, count: int, window: float) -> None:
    pki = TestCa(datetime.now(UTC))
    ca = TimestampingCa(pki)
    server, addr = await start_fake_ca(ca, tmp, datetime.now(UTC))
    (tmp / "token").write_text(NODE_TOKEN)
    pairs = tuple((f"ns{i % 10}", f"sa{i}") for i in range(count))
    config = dataclasses.replace(
        node_agent_config(tmp, addr, pairs),
        report_interval=timedelta(0),  # the bench hands the taint in itself
        taint_resign_window=timedelta(seconds=window),
    )
    agent = Agent(config, clock=SystemClock())
    await agent.start()
    try:
        scheduler = scheduler_of(agent)
        await wait(lambda: scheduler.has_valid_certificate(), 300)
        print(f"node agent serving {count} identities; taint window {window:g} s")

        def all_renewed(generations: dict[SpiffeId, int]) -> Callable[[], bool]:
            states = scheduler.states.values()
            return lambda: all(s.generation > generations[s.identity] for s in states)

        # Baseline: every identity at once.
        mark = len(ca.arrivals)
        generations = {s.identity: s.generation for s in scheduler.states.values()}
        scheduler.request_rotation()
        at_once = await wait(all_renewed(generations), 600)
        at_once_arrivals = ca.arrivals[mark:]

        # meshca: the authority of every leaf is tainted, just now.
        mark = len(ca.arrivals)
        generations = {s.identity: s.generation for s in scheduler.states.values()}
        authority = {leaf_authority(s.current.leaf) for s in scheduler.states.values() if s.current}
        (tainted,) = authority
        assert tainted is not None
        moved = scheduler.taints_learned({tainted: datetime.now(UTC)}, SOURCE_REPORT)
        paced = await wait(all_renewed(generations), window * 3 + 60)
        paced_arrivals = ca.arrivals[mark:]

        base_peak, paced_peak = peak_per_second(at_once_arrivals), peak_per_second(paced_arrivals)
        print(f"{'':40}{'peak CSRs/s':>12}{'CSRs':>7}{'seconds':>9}")
        rows = (
            ("baseline: all identities at once", base_peak, len(at_once_arrivals), at_once),
            ("meshca: taint, paced over the window", paced_peak, len(paced_arrivals), paced),
        )
        for name, peak, csrs, seconds in rows:
            print(f"{name:40}{peak:>12}{csrs:>7}{seconds:>9.2f}")
        print(
            f"rescheduled {moved}; expected paced peak about {count / window:.0f}/s "
            f"(identities / window, plus random bunching); ratio of peaks (meshca / baseline): "
            f"{paced_peak / base_peak:.3f}"
        )
    finally:
        await agent.stop()
        await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=300)
    parser.add_argument("--window", type=float, default=30.0, help="taint window, seconds")
    args = parser.parse_args()
    configure_logging("WARNING")  # a line per identity at INFO would drown the figures
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mtp-") as tmp:
        asyncio.run(run(Path(tmp), args.identities, args.window))


if __name__ == "__main__":
    main()
