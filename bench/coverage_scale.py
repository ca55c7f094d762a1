"""Coverage at 100,000 agents across 3 CA replicas (issue #17): is the figure exact, how stale,
how much does it cost the API server and the CA?

Run: `.venv/bin/python -m bench.coverage_scale [--agents 100000] [--replicas 3]
[--report-interval 120] [--poll 15]`

Fed through the same code path as the CA, in one process with an injected clock: each agent's
periodic report is `AgentReports.record_report` with the `Caller` its pod-bound token would
prove (what the RPC edge calls after authentication), mostly on one replica, one in a
hundred moving between replicas every period (as connections get rebalanced; not in the idle
period). Every poll each replica publishes
through the real `ConfigMapLedgerSink` to the test API server (`tests/support/kube_api`, real
HTTP, counting requests), and a reader (as every replica's rotator does each round) merges all
replicas' shards and computes coverage. A new bundle reaches the agents in waves (a fifth of the
fleet per report period); at the end exactly 95 % minus one, then 95 %, trust it.

Every replica also merges every poll (its rotator does, and its own merge is what lets it
reclaim an agent that came back, `AgentReports.reclaim`), from the same listing.

Prints, per phase: simulated seconds from the last agent's report to the figure every reader
sees, API writes per replica per report period (and per minute) idle and during the waves, the
largest object, the CA's memory for reports per 10,000 agents (tracemalloc of one replica's
table and of a reader's merged view, and RSS growth), merge CPU per round idle (nothing
changed) and under churn (a wave) with the shards it parsed, and the gate's decision at
95 % - 1 and 95 %, which must be exact (False, True). The ratio line compares merge CPU under
churn to idle.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.authn import Caller
from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.coverage import AgentCoverage, authority_coverage
from ca_server.fleet.entries import FleetReports
from ca_server.fleet.leaf_ledger import LeafLedger
from ca_server.fleet.report_shards import ShardMerger
from ca_server.kube.replica_reports import ConfigMapLedgerSink
from certs import KeySpec, SpiffeId, new_self_signed_authority
from certs.bundle import bundle_digest
from tests.support.kube_api import KubeApiServer

NAMESPACE = "istio-system"
START = datetime(2026, 12, 1, tzinfo=UTC)


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _callers(count: int) -> list[Caller]:
    callers = []
    for n in range(count):
        namespace = f"ns-{n % 200}"
        account = f"sa-{n % 1000}"
        callers.append(
            Caller(
                SpiffeId("cluster.local", namespace, account),
                "kubernetes-offline",
                subject=f"system:serviceaccount:{namespace}:{account}",
                pod_name=f"{account}-{n:06d}-x7k2p",
                pod_uid=f"{n:08x}-3f1e-4c2a-9b7d-1234567890ab",
                extra={"cluster_id": "Kubernetes"},
            )
        )
    return callers


class Fleet:
    def __init__(self, args: argparse.Namespace, api: KubeApiServer) -> None:
        self.args = args
        self.api = api
        self.callers = _callers(args.agents)
        self.ledgers = [LeafLedger() for _ in range(args.replicas)]
        self.agents = [AgentReports() for _ in range(args.replicas)]
        self.sinks = [
            ConfigMapLedgerSink(api.api_client(), NAMESPACE, f"ca-{i}")
            for i in range(args.replicas)
        ]
        self.reader = ConfigMapLedgerSink(api.api_client(), NAMESPACE, "reader")
        a = new_self_signed_authority(
            KeySpec(), "cluster.local", now=START, lifetime=timedelta(days=365)
        ).roots[0]
        b = new_self_signed_authority(
            KeySpec(), "cluster.local", now=START, lifetime=timedelta(days=365)
        ).roots[0]
        self.authorities = [("A", a), ("B", b)]
        self.old, self.both = bundle_digest([a]), bundle_digest([a, b])
        self.has_new = [False] * args.agents
        self.now = START
        self.last_report_at = START
        self.list_cpu: list[float] = []
        self.parsed: list[int] = []  # shards the reader parsed, per round

    def replica_of(self, n: int, period: int, rebalance: bool) -> int:
        moves = rebalance and n % 100 == 0
        return (n + period) % self.args.replicas if moves else n % self.args.replicas

    def run_period(
        self, period: int, merge_cpu: list[float], rebalance: bool = True
    ) -> FleetReports:
        """One report period: every agent reports once, spread over the polls; each poll every
        replica publishes and the reader merges (timed: the merge itself; the list call that
        fetched the shards is timed apart, since a running CA reads them from a watch)."""
        polls = max(1, self.args.report_interval // self.args.poll)
        per_poll = -(-len(self.callers) // polls)
        fleet = self.reader.agents(self.now)
        for poll in range(polls):
            for n in range(poll * per_poll, min(len(self.callers), (poll + 1) * per_poll)):
                digest = self.both if self.has_new[n] else self.old
                agents = self.agents[self.replica_of(n, period, rebalance)]
                agents.record_report(self.callers[n], f"agent-{n}", digest, ["aa"], self.now)
            self.last_report_at = self.now
            self.now += timedelta(seconds=self.args.poll)
            for ledger, agents, sink in zip(self.ledgers, self.agents, self.sinks, strict=True):
                sink.save(ledger, agents, self.now)
            started = time.process_time()
            reports = self.reader._reports()
            self.list_cpu.append(time.process_time() - started)
            started = time.process_time()
            fleet = self.reader._merged(reports, self.now)
            merge_cpu.append(time.process_time() - started)
            self.parsed.append(self.reader._merger.reparsed)
            for sink in self.sinks:
                sink._merged(reports, self.now)
        return fleet

    def gate(self, fleet: FleetReports) -> AgentCoverage:
        counted = authority_coverage(self.authorities, fleet)
        return AgentCoverage(
            counted.trusting["B"], counted.reporting, counted.unseen, counted.unreadable
        )

    def writes(self) -> int:
        return self.api.count("create", "configmaps") + self.api.count("update", "configmaps")

    def largest_object(self) -> int:
        return max(
            len(str(cm.get("data") or {}))
            for cm in self.api.list("configmaps", namespace=NAMESPACE)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=100_000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--report-interval", type=int, default=120, help="seconds")
    parser.add_argument("--poll", type=int, default=15, help="--ca-reload-interval, seconds")
    args = parser.parse_args()

    api = KubeApiServer().start()
    api.create_namespace(NAMESPACE)
    try:
        fleet = Fleet(args, api)
        rss_before = _rss_kib()
        # Settle: every agent reported once (all on the old bundle).
        started_writes, started_at = fleet.writes(), fleet.now
        merged = fleet.run_period(0, [])
        rss_growth = _rss_kib() - rss_before
        print(
            f"{args.agents} agents, {args.replicas} replicas, report every "
            f"{args.report_interval}s, poll {args.poll}s"
        )
        print(
            f"settled: {len(merged.entries)} reporting, unseen {merged.dropped}, "
            f"unreadable {merged.unreadable}"
        )
        per_10k = 10_000 / args.agents
        reports = fleet.reader._reports()
        tracemalloc.start()
        merger = ShardMerger()
        view = merger.merge(fleet.reader._processes(reports), fleet.now)
        reader_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del view, merger, reports
        tracemalloc.start()
        table = AgentReports()
        for n, caller in enumerate(fleet.callers[:10_000]):
            table.record_report(caller, f"agent-{n}", fleet.old, ["aa"], fleet.now)
        table_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del table
        print(
            "CA memory for reports per 10,000 agents: its own table "
            f"{table_bytes / 2**20:.1f} MiB (10,000 entries), the merged view of every replica "
            f"(parsed shards + candidates + fleet) {reader_bytes * per_10k / 2**20:.1f} MiB; "
            "RSS growth of "
            f"this process (3 tables, the reader, the API server's copy) "
            f"{rss_growth * per_10k / 1024:.1f} MiB"
        )

        # Idle: a period where nothing a decision reads changes.
        idle_cpu: list[float] = []
        before, at, parsed_from = fleet.writes(), fleet.now, len(fleet.parsed)
        fleet.run_period(1, idle_cpu, rebalance=False)
        periods = (fleet.now - at).total_seconds() / args.report_interval
        idle_writes = (fleet.writes() - before) / periods / args.replicas
        idle_parsed = sum(fleet.parsed[parsed_from:]) / len(idle_cpu)

        # Waves: a fifth of the fleet gets the new bundle each period.
        churn_cpu: list[float] = []
        before, at, parsed_from = fleet.writes(), fleet.now, len(fleet.parsed)
        wave = args.agents // 5
        for period in range(2, 7):
            for n in range((period - 2) * wave, min(args.agents, (period - 1) * wave)):
                fleet.has_new[n] = True
            merged = fleet.run_period(period, churn_cpu)
            counted = fleet.gate(merged)
            print(f"  wave {period - 1}: {counted}")
        periods = (fleet.now - at).total_seconds() / args.report_interval
        churn_writes = (fleet.writes() - before) / periods / args.replicas
        churn_parsed = sum(fleet.parsed[parsed_from:]) / len(churn_cpu)
        # Time from the last agent's report to the figure every reader sees.
        lag = (fleet.now - fleet.last_report_at).total_seconds()
        print(
            f"last agent's report to the shared figure: {lag:.0f} s simulated (one poll: "
            "publish, then every replica's next merge)"
        )
        per_minute = 60 / args.report_interval
        print(
            f"API writes per replica per report period ({args.report_interval} s): idle "
            f"{idle_writes:.1f}, during the waves {churn_writes:.1f} (per minute: "
            f"{idle_writes * per_minute:.1f}, {churn_writes * per_minute:.1f}; settling: "
            f"{(fleet.writes() - started_writes):d} in all since {started_at.isoformat()})"
        )
        print(f"largest object: {fleet.largest_object() / 1024:.0f} KiB (limit 1024 KiB)")
        idle = sum(idle_cpu) / len(idle_cpu)
        churn = sum(churn_cpu) / len(churn_cpu)
        print(
            f"merge CPU per round: idle {idle * 1000:.2f} ms ({idle_parsed:.1f} shards parsed), "
            f"under churn {churn * 1000:.0f} ms ({churn_parsed:.1f} shards parsed) (ratio "
            f"{churn / idle if idle else float('inf'):.0f}x); the list call + JSON decode "
            f"a reader without a watch pays: {sum(fleet.list_cpu) / len(fleet.list_cpu) * 1000:.0f}"
            " ms per round"
        )

        # Exactness at 95 %: every agent reverts, then exactly 95 % - 1, then 95 % trust it.
        threshold = args.agents * 95 // 100
        decisions = []
        for trusting in (threshold - 1, threshold):
            fleet.has_new = [n < trusting for n in range(args.agents)]
            merged = fleet.run_period(8, [])
            counted = fleet.gate(merged)
            decisions.append(counted.reaches(0.95))
            print(f"gate at {counted}: activates={counted.reaches(0.95)}")
        exact = decisions == [False, True]
        print(f"gate decision exact at 95 %: {exact}")
        return 0 if exact else 1
    finally:
        api.stop()


if __name__ == "__main__":
    sys.exit(main())
