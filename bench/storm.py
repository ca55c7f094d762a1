"""A certificate storm against a real CA: N distinct identities asking at once, and a renewal
storm on top of it.

Run: `.venv/bin/python -m bench.storm [--identities 10000] [--in-flight 256] [--renewals 2000]
[--workers N] [--max-in-flight M]`

It starts `meshca ca` (default workers unless `--workers`), mints one development token per
identity (distinct service accounts `storm-<i>`, so every request is a token the CA has not seen:
no authentication cache hit), prepares a fresh P-256 key and CSR per request, then releases
every first-certificate request and, at the same instant, `--renewals` requests marked as
renewals (`x-meshca-renewal: 1`, the header meshca agents send when they still hold a valid
certificate), `--in-flight` at a time in total, spread over several connections so every
worker gets its share.

A client behaves as meshca's agent does: a refusal with `grpc-retry-pushback-ms` is retried
after the hint times a factor in [1, 1.5]; other retryable codes (UNAVAILABLE, INTERNAL, ...)
after a jittered backoff; each attempt has a 10 s deadline (the agent's default); like an
agent it keeps trying until it has a certificate, up to `--give-up-after`. It prints
wall time, certificates obtained, failed identities (no certificate in the end), refusals
with a retry hint, DEADLINE_EXCEEDED count, and p50/p99 of the time from a request's first
send to its certificate (retries included), for first certificates and renewals separately,
plus the CA's own count of shed requests and issuances from `/metrics`.

`--kubernetes` runs the CA in Kubernetes mode against the fake API server
(`tests/support/kube_api`, its own process) with opaque service-account tokens the CA must
check with TokenReview, rate limited by `--kube-qps`/`--kube-burst` as in a cluster: requests
then wait *inside* the CA, which is where admission control sheds (and renewals first). It also
prints the TokenReviews the API server answered and its API calls per 1,000 certificates
(`bench/kube_api_calls.py` compares TokenReview with offline validation).

`--reports M` runs a report storm instead (`meshca.v1.AgentReportService/Report`, meshca's
periodic agent report): `--identities` agents (pods of the fake API server, in-process here, each
with its own projected token, a real JWT its TokenReview also knows) each report M times, once
per round, `--in-flight` at a time, each agent always on the same one of a few connections (an
agent keeps its connection), against a CA in Kubernetes mode with `--token-validation
tokenreview` and then `offline`. A report refused with a retry hint is counted as shed and not
retried (the agent reports again next period). Per mode it prints, for the first round (tokens
the CA has not seen) and for the later rounds (steady state): reports/s, shed, failures, and the
API calls per 1,000 reports with their breakdown — the CA's background rounds (its replica
ConfigMap, its peers' list; per interval, not per report) included — and TokenReviews per
distinct token (at most one per worker: the verified-token cache).

`--report-agents K` runs the certificate storm twice, on a fresh CA each time: alone, then while
K of its identities keep sending agent reports every `--report-period` seconds (± 20 %) — the
baseline measured in the same run. It prints both storms, the reports sent/answered/shed, and
the ratio of the p99s with and without reports (admission puts reports last and never in a
certificate's slot; what reports still share with certificates is the CPU).

The client runs on the same machine as the CA (one Python process); on 2 cores it takes a
noticeable share of the CPU, so read the figures as a lower bound of the CA's capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from agent.config import DEFAULT_REPORT_INTERVAL
from ca_server.config import RPC_SERVER_CHOICES
from ca_server.dev_issuer import load_dev_issuer
from ca_server.token_cache import VerifiedTokenCache
from certs import SpiffeId, build_csr, generate_private_key
from meshca_proto import ca_pb2, ca_pb2_grpc, report_pb2, report_pb2_grpc
from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer
from tests.support.metrics import sample_value
from tests.support.processes import child_env, stop_child, wait_for

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}
ATTEMPT_TIMEOUT = 10.0
CONNECTIONS = 16
REPORT_INTERVAL_MINUTES = DEFAULT_REPORT_INTERVAL.total_seconds() / 60
BACKGROUND = frozenset({"configmaps", "secrets", "leases"})


@dataclass
class Outcome:
    renewal: bool
    latency: float | None = None  # first attempt to certificate; None when it never came
    hinted_refusals: int = 0
    hinted_ms: int = 0  # the retry hints it was given, summed
    deadline_exceeded: int = 0
    other_errors: list[str] = field(default_factory=list)


@dataclass
class Job:
    renewal: bool
    token: str
    csr: str


def prepare_jobs(data_dir: Path | None, identities: int, renewals: int) -> list[Job]:
    """Dev-issuer JWTs from `data_dir`, or (None) the opaque tokens `kube_tokens` registers."""
    issuer = load_dev_issuer(data_dir) if data_dir is not None else None
    jobs = []
    for index in range(identities + renewals):
        renewal = index >= identities
        account = f"storm-{index % identities}" if renewal else f"storm-{index}"
        identity = SpiffeId("cluster.local", "storm", account)
        if issuer is not None:
            token = issuer.mint("storm", account, pod_name=f"{account}-pod")
        else:
            token = f"storm-token-{index % identities}"
        jobs.append(Job(renewal, token, build_csr(generate_private_key(), identity)))
    return jobs


def kube_tokens(identities: int) -> list[dict[str, object]]:
    return [
        {
            "token": f"storm-token-{index}",
            "namespace": "storm",
            "serviceAccount": f"storm-{index}",
            "audiences": ["istio-ca"],
        }
        for index in range(identities)
    ]


@contextlib.contextmanager
def fake_api_server(workdir: Path, identities: int) -> Iterator[tuple[Path, str]]:
    """The fake API server in its own process, knowing every storm token; yields the
    kubeconfig and the server's URL."""
    tokens = workdir / "tokens.json"
    tokens.write_text(json.dumps(kube_tokens(identities)))
    seed = workdir / "seed.json"
    seed.write_text(
        json.dumps(
            [
                {"kind": "Namespace", "metadata": {"name": name}}
                for name in ("istio-system", "storm")
            ]
        )
    )
    port_file = workdir / "api-port"
    kubeconfig = workdir / "kubeconfig"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.kube_api",
            "--port-file",
            str(port_file),
            "--kubeconfig",
            str(kubeconfig),
            "--tokens-file",
            str(tokens),
            "--seed-file",
            str(seed),
        ],
        env=child_env(),
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(port_file.exists, 60, "the fake API server")
        yield kubeconfig, f"http://127.0.0.1:{port_file.read_text().strip()}"
    finally:
        stop_child(proc)


def api_calls(api_url: str) -> dict[str, int]:
    """Requests the fake API server answered, by `verb resource`."""
    with urllib.request.urlopen(f"{api_url}/_test/counts", timeout=10) as response:
        counts = json.loads(response.read())
    return {f"{c['verb']} {c['resource']}": int(c["count"]) for c in counts}


async def open_channels(ca: CaProcess) -> list[grpc.aio.Channel]:
    """`CONNECTIONS` TLS connections to the CA, ready (spread over its workers)."""
    credentials = grpc.ssl_channel_credentials(ca.root_cert_path.read_bytes())
    options = [("grpc.ssl_target_name_override", "localhost")]
    channels = [
        grpc.aio.secure_channel(ca.addr, credentials, options=options) for _ in range(CONNECTIONS)
    ]
    for channel in channels:
        await channel.channel_ready()
    return channels


SHED = "shed"


async def agent_report(stub: report_pb2_grpc.AgentReportServiceStub, index: int, token: str) -> str:
    """One report of agent `index`: "OK", `SHED` (refused with a retry hint: the agent reports
    again next period) or the gRPC status name."""
    try:
        await stub.Report(
            report_pb2.AgentReportRequest(agent_id=f"agent-{index}"),
            metadata=(("authorization", f"Bearer {token}"),),
            timeout=ATTEMPT_TIMEOUT,
        )
    except grpc.aio.AioRpcError as error:
        if "grpc-retry-pushback-ms" in dict(error.trailing_metadata() or ()):
            return SHED
        return error.code().name
    return "OK"


@dataclass
class ReportLoad:
    """Agent reports sent while the certificate storm ran (`--report-agents`)."""

    sent: int = 0
    answered: int = 0
    shed: int = 0
    failures: list[str] = field(default_factory=list)


async def keep_reporting(
    ca: CaProcess, tokens: list[str], period: float, done: asyncio.Event, load: ReportLoad
) -> None:
    """Each token is an agent reporting every `period` (± 20 %, as the agent does) until `done`;
    a report refused with a hint is not retried (the agent waits for its next period)."""
    channels = await open_channels(ca)
    stubs = [report_pb2_grpc.AgentReportServiceStub(channel) for channel in channels]
    rng = random.Random(11)

    async def agent(index: int) -> None:
        pause = rng.uniform(0, period)
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), pause)
                return
            load.sent += 1
            outcome = await agent_report(stubs[index % CONNECTIONS], index, tokens[index])
            if outcome == "OK":
                load.answered += 1
            elif outcome == SHED:
                load.shed += 1
            else:
                load.failures.append(outcome)
            pause = period * rng.uniform(0.8, 1.2)

    await asyncio.gather(*(agent(index) for index in range(len(tokens))))
    for channel in channels:
        await channel.close()


async def run_storm(
    ca: CaProcess,
    jobs: list[Job],
    in_flight: int,
    give_up_after: float,
    reporters: tuple[list[str], float] | None = None,
) -> tuple[list[Outcome], float, ReportLoad]:
    """The storm; with `reporters` (tokens, period) agents keep reporting while it runs."""
    load, done = ReportLoad(), asyncio.Event()
    reporting = (
        asyncio.create_task(keep_reporting(ca, reporters[0], reporters[1], done, load))
        if reporters
        else None
    )
    channels = await open_channels(ca)
    stubs = [ca_pb2_grpc.IstioCertificateServiceStub(channel) for channel in channels]
    slots = asyncio.Semaphore(in_flight)
    rng = random.Random(7)
    order = list(range(len(jobs)))
    rng.shuffle(order)  # first certificates and renewals arrive interleaved

    async def one(index: int) -> Outcome:
        job = jobs[index]
        outcome = Outcome(job.renewal)
        stub = stubs[index % CONNECTIONS]
        headers = [("authorization", f"Bearer {job.token}")]
        if job.renewal:
            headers.append(("x-meshca-renewal", "1"))
        request = ca_pb2.IstioCertificateRequest(csr=job.csr)
        started: float | None = None
        attempt = 0
        while started is None or time.perf_counter() - started < give_up_after:
            attempt += 1
            async with slots:
                # Latency counts from the first send: waiting for one of the client's own
                # `--in-flight` slots before that is this benchmark's queue, not the CA's.
                started = started or time.perf_counter()
                try:
                    await stub.CreateCertificate(request, metadata=headers, timeout=ATTEMPT_TIMEOUT)
                except grpc.aio.AioRpcError as exc:
                    error = exc
                else:
                    outcome.latency = time.perf_counter() - started
                    return outcome
            hint = dict(error.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                outcome.deadline_exceeded += 1
            if hint is not None:
                outcome.hinted_refusals += 1
                outcome.hinted_ms += int(hint)
                delay = int(hint) / 1000 * rng.uniform(1.0, 1.5)
            elif error.code() in RETRYABLE:
                outcome.other_errors.append(error.code().name)
                delay = min(5.0, 0.1 * 2 ** min(attempt, 10)) * rng.uniform(0.5, 1.0)
            else:
                outcome.other_errors.append(f"{error.code().name}: {error.details()}")
                return outcome
            await asyncio.sleep(delay)
        return outcome

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(index) for index in order))
    wall = time.perf_counter() - started
    done.set()
    if reporting is not None:
        await reporting
    for channel in channels:
        await channel.close()
    return list(outcomes), wall, load


def _ms(values: list[float], q: int) -> str:
    if len(values) < 2:
        return "-"
    return f"{statistics.quantiles(values, n=100)[q - 1] * 1000:.0f} ms"


def report(outcomes: list[Outcome], wall: float, metrics: str) -> None:
    got = [o for o in outcomes if o.latency is not None]
    print(f"wall time {wall:.1f} s for {len(outcomes)} requests: {len(got) / wall:.0f} certs/s")
    print(f"failed (no certificate in the end): {len(outcomes) - len(got)}")
    refusals = sum(o.hinted_refusals for o in outcomes)
    hinted = sum(o.hinted_ms for o in outcomes)
    print(
        f"refusals with a retry hint: {refusals} (first certificates "
        f"{sum(o.hinted_refusals for o in outcomes if not o.renewal)}, renewals "
        f"{sum(o.hinted_refusals for o in outcomes if o.renewal)}; mean hint "
        f"{hinted / max(refusals, 1):.0f} ms)"
    )
    print(f"DEADLINE_EXCEEDED: {sum(o.deadline_exceeded for o in outcomes)}")
    others = [error for o in outcomes for error in o.other_errors]
    print(f"other errors: {len(others)} {sorted(set(others))[:5]}")
    for name, renewal in (("first certificates", False), ("renewals", True)):
        latencies = [o.latency for o in got if o.renewal is renewal and o.latency is not None]
        count = sum(o.renewal is renewal for o in outcomes)
        print(
            f"{name:18}: {len(latencies)}/{count} obtained, "
            f"p50 {_ms(latencies, 50)}, p99 {_ms(latencies, 99)}"
        )
    shed_first = sample_value(metrics, "meshca_ca_requests_shed_total", {"kind": "first"})
    shed_renewal = sample_value(metrics, "meshca_ca_requests_shed_total", {"kind": "renewal"})
    issued = sample_value(metrics, "citadel_server_success_cert_issuance_count")
    print(f"CA: issued {issued:.0f}, shed {shed_first:.0f} first + {shed_renewal:.0f} renewals")


@dataclass
class ReportRound:
    reports: int = 0
    shed: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    calls: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, other: ReportRound) -> None:
        self.reports += other.reports
        self.shed += other.shed
        self.failures += other.failures
        self.seconds += other.seconds
        for key, count in other.calls.items():
            self.calls[key] = self.calls.get(key, 0) + count

    @property
    def background_calls(self) -> int:
        """The CA's own rounds (its replica ConfigMap, its peers' list, the root Secret): made
        every `--ca-reload-interval` whatever the reports do."""
        return sum(n for (_, resource), n in self.calls.items() if resource in BACKGROUND)

    def per_thousand(self, calls: int) -> float:
        return calls * 1000 / max(self.reports, 1)

    def describe(self, name: str) -> str:
        answered = self.reports - self.shed - len(self.failures)
        background = self.background_calls
        for_reports = self.per_thousand(sum(self.calls.values()) - background)
        breakdown = (
            ", ".join(
                f"{verb} {resource} {n}" for (verb, resource), n in sorted(self.calls.items())
            )
            or "none"
        )
        return (
            f"{name}: {self.reports} reports in {self.seconds:.1f} s "
            f"({answered / max(self.seconds, 1e-9):.0f} answered/s), shed {self.shed}, "
            f"failed {len(self.failures)} {sorted(set(self.failures))[:3]}; API calls per 1,000 "
            f"reports: for the reports {for_reports:.1f}, the CA's background rounds "
            f"{self.per_thousand(background):.1f} ({breakdown})"
        )


def seed_agents(server: KubeApiServer, agents: int) -> list[str]:
    """One running pod per agent, each with its projected token (a JWT bound to the pod)."""
    server.create_namespace("istio-system")
    server.create_namespace("storm")
    tokens = []
    for index in range(agents):
        pod, account = f"agent-{index}", f"storm-{index % 50}"
        server.create_pod("storm", pod, service_account=account, node_name=f"node-{index % 10}")
        tokens.append(
            server.issue_service_account_token(
                "storm", account, audiences=["istio-ca"], pod_name=pod
            )
        )
    return tokens


@dataclass
class ReportPhases:
    """A burst of every agent's first report, the re-reports of the agents it shed until each
    had one answered (as agents would, a period later), then `--reports` steady rounds."""

    burst: ReportRound
    catch_up: ReportRound
    catch_up_rounds: int
    steady: ReportRound


async def report_phases(
    ca: CaProcess, server: KubeApiServer, tokens: list[str], rounds: int, in_flight: int
) -> ReportPhases:
    channels = await open_channels(ca)
    stubs = [report_pb2_grpc.AgentReportServiceStub(channel) for channel in channels]
    slots = asyncio.Semaphore(in_flight)

    async def one(index: int, result: ReportRound) -> bool:
        async with slots:
            outcome = await agent_report(stubs[index % CONNECTIONS], index, tokens[index])
        if outcome == SHED:
            result.shed += 1
        elif outcome != "OK":
            result.failures.append(outcome)
        return outcome == "OK"

    async def round_of(agents: list[int]) -> tuple[ReportRound, list[int]]:
        """Every agent in `agents` reports once; the API server's counts are this round's."""
        result = ReportRound(reports=len(agents))
        server.reset_counts()
        started = time.perf_counter()
        answered = await asyncio.gather(*(one(index, result) for index in agents))
        result.seconds = time.perf_counter() - started
        result.calls = {k: n for k, n in server.request_counts().items() if k[0] != "watch"}
        return result, [index for index, ok in zip(agents, answered, strict=True) if not ok]

    everyone = list(range(len(tokens)))
    burst, pending = await round_of(everyone)
    catch_up, catch_up_rounds = ReportRound(), 0
    while pending and catch_up_rounds < 100:
        await asyncio.sleep(0.2)
        result, pending = await round_of(pending)
        catch_up.add(result)
        catch_up_rounds += 1
    steady = ReportRound()
    for _ in range(rounds):
        result, _ = await round_of(everyone)
        steady.add(result)
    for channel in channels:
        await channel.close()
    return ReportPhases(burst, catch_up, catch_up_rounds, steady)


def measure_reports(mode: str, args: argparse.Namespace, extra: list[str]) -> ReportPhases:
    with KubeApiServer() as server, tempfile.TemporaryDirectory(prefix="meshca-storm-") as tmp:
        prepared = time.perf_counter()
        tokens = seed_agents(server, args.identities)
        kubeconfig = server.write_kubeconfig(Path(tmp) / "kubeconfig")
        ca = CaProcess(
            Path(tmp) / "data",
            "--log-level",
            "WARNING",
            "--kubeconfig",
            str(kubeconfig),
            "--no-root-configmaps",
            "--token-validation",
            mode,
            "--kube-qps",
            args.kube_qps,
            "--kube-burst",
            args.kube_burst,
            *extra,
        )
        ca.start(timeout=120)
        try:
            # Start-up traffic is not per report: let the CA open its watch of the root Secret.
            deadline = time.monotonic() + 10
            while server.count("watch", "secrets") == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            print(
                f"{mode}: {len(tokens)} agents seeded and CA started in "
                f"{time.perf_counter() - prepared:.1f} s"
            )
            return asyncio.run(report_phases(ca, server, tokens, args.reports, args.in_flight))
        finally:
            ca.stop()


def report_storm(args: argparse.Namespace, extra: list[str]) -> None:
    steady = {}
    for mode in ("tokenreview", "offline"):
        phases = measure_reports(mode, args, extra)
        print(f"{mode:>11} " + phases.burst.describe("burst (every agent at once, new tokens)"))
        print(
            f"{mode:>11} "
            + phases.catch_up.describe(f"shed agents again ({phases.catch_up_rounds} rounds)")
        )
        print(f"{mode:>11} " + phases.steady.describe(f"steady ({args.reports} rounds)"))
        reviews = sum(
            phase.calls.get(("create", "tokenreviews"), 0)
            for phase in (phases.burst, phases.catch_up, phases.steady)
        )
        print(f"{mode:>11} TokenReviews per distinct token: {reviews / args.identities:.2f}")
        steady[mode] = phases.steady
    review, offline = (
        steady[m].per_thousand(sum(steady[m].calls.values()) - steady[m].background_calls)
        for m in ("tokenreview", "offline")
    )
    print(
        f"steady state, API calls per 1,000 reports made for the reports: tokenreview "
        f"{review:.1f}, offline {offline:.1f} (the CA's background rounds come on top, per "
        "interval, not per report)"
    )
    # Beyond this run's few seconds: a verified token is kept at most `max_ttl`, then reviewed
    # again by the worker that sees it next.
    cache_minutes = VerifiedTokenCache().max_ttl.total_seconds() / 60
    print(
        f"(derived, not measured: the verified-token cache keeps a token {cache_minutes:.0f} min "
        f"at most, so over hours tokenreview costs about one review per token per worker every "
        f"{cache_minutes:.0f} min: {1000 * REPORT_INTERVAL_MINUTES / cache_minutes:.0f} per 1,000 "
        f"reports at the agent's default {REPORT_INTERVAL_MINUTES:.0f} min interval; offline: 0)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--identities", type=int, default=10_000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--renewals", type=int, default=None, help="default: identities / 5")
    parser.add_argument("--workers", type=int, default=None, help="default: meshca's default")
    parser.add_argument("--max-in-flight", type=int, default=None, help="the CA's limit")
    parser.add_argument(
        "--give-up-after", type=float, default=600, help="seconds a client keeps trying"
    )
    parser.add_argument(
        "--kubernetes", action="store_true", help="TokenReview against the fake API server"
    )
    parser.add_argument("--kube-qps", default="50", help="the CA's TokenReview rate (default 50)")
    parser.add_argument("--kube-burst", default="100", help="and burst (default 100)")
    parser.add_argument(
        "--reports",
        type=int,
        default=0,
        help="run a report storm instead: every agent (--identities) reports this many times",
    )
    parser.add_argument(
        "--report-agents",
        type=int,
        default=0,
        help="run the certificate storm twice, the second time with this many of its "
        "identities reporting throughout (see --report-period)",
    )
    parser.add_argument(
        "--report-period", type=float, default=1.0, help="seconds between an agent's reports"
    )
    parser.add_argument(
        "--rpc-server",
        nargs="+",
        choices=RPC_SERVER_CHOICES,
        default=None,
        help="the CA's gRPC server; several: the certificate storm once on each, in this run",
    )
    args = parser.parse_args()
    renewals = args.identities // 5 if args.renewals is None else args.renewals
    extra = []
    if args.workers is not None:
        extra += ["--workers", str(args.workers)]
    if args.max_in_flight is not None:
        extra += ["--max-in-flight", str(args.max_in_flight)]
    if args.rpc_server and len(args.rpc_server) > 1 and not args.reports:
        for server in args.rpc_server:
            print(f"-- --rpc-server {server}")
            certificate_storm(args, [*extra, "--rpc-server", server], renewals)
        return
    if args.rpc_server:
        extra += ["--rpc-server", args.rpc_server[0]]
    if args.reports:
        report_storm(args, extra)
        return
    if not args.report_agents:
        certificate_storm(args, extra, renewals)
        return
    print("-- baseline: the certificate storm alone")
    alone = certificate_storm(args, extra, renewals)
    print(
        f"-- the same storm while {args.report_agents} agents report every {args.report_period:g} s"
    )
    mixed = certificate_storm(args, extra, renewals, args.report_agents)
    load = mixed.load
    print(
        f"reports during the storm: {load.sent} sent, {load.answered} answered, {load.shed} shed "
        f"with a hint, {len(load.failures)} failed {sorted(set(load.failures))[:3]}"
    )
    for name, renewal in (("first certificates", False), ("renewals", True)):
        before, after = alone.p99(renewal), mixed.p99(renewal)
        if before and after:
            print(
                f"{name} p99 with reports ÷ without: {after / before:.2f} "
                f"({after * 1000:.0f} ms vs {before * 1000:.0f} ms)"
            )
    print(
        f"failed certificates: {mixed.failed} with reports, {alone.failed} without; wall time "
        f"ratio {mixed.wall / alone.wall:.2f}"
    )


@dataclass
class StormResult:
    outcomes: list[Outcome]
    wall: float
    load: ReportLoad

    @property
    def failed(self) -> int:
        return sum(o.latency is None for o in self.outcomes)

    def p99(self, renewal: bool) -> float | None:
        latencies = [o.latency for o in self.outcomes if o.renewal is renewal and o.latency]
        return statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else None


def certificate_storm(
    args: argparse.Namespace, ca_args: list[str], renewals: int, report_agents: int = 0
) -> StormResult:
    """One storm against a fresh CA, printed; `report_agents` of its identities keep reporting
    (every `--report-period`) while it runs."""
    extra = list(ca_args)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshca-storm-")))
        api_url = None
        if args.kubernetes:
            kubeconfig, api_url = stack.enter_context(fake_api_server(workdir, args.identities))
            extra += ["--kubeconfig", str(kubeconfig), "--no-root-configmaps"]
            extra += ["--kube-qps", args.kube_qps, "--kube-burst", args.kube_burst]
        ca = CaProcess(workdir / "data", "--log-level", "WARNING", *extra)
        ca.start()
        try:
            prepared = time.perf_counter()
            jobs = prepare_jobs(None if args.kubernetes else ca.data_dir, args.identities, renewals)
            print(
                f"prepared {len(jobs)} tokens and CSRs in {time.perf_counter() - prepared:.1f} s; "
                f"{args.identities} first certificates + {renewals} renewals, "
                f"{args.in_flight} in flight"
            )
            reporters = (
                ([job.token for job in jobs[:report_agents]], args.report_period)
                if report_agents
                else None
            )
            outcomes, wall, load = asyncio.run(
                run_storm(ca, jobs, args.in_flight, args.give_up_after, reporters)
            )
            url = f"{ca.monitoring_url}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                metrics = response.read().decode()
            calls = api_calls(api_url) if api_url else None
        finally:
            ca.stop()
    report(outcomes, wall, metrics)
    if calls is not None:
        issued = sum(o.latency is not None for o in outcomes)
        print(f"TokenReviews answered by the API server: {calls.get('create tokenreviews', 0)}")
        per_thousand = sum(calls.values()) * 1000 / max(issued, 1)
        print(
            f"API calls per 1,000 certificates: {per_thousand:.0f} (all requests, start-up "
            f"included: {dict(sorted(calls.items()))}); offline validation's figure: "
            "bench/kube_api_calls.py"
        )
    return StormResult(outcomes, wall, load)


if __name__ == "__main__":
    main()
