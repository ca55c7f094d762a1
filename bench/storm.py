"""A certificate storm against a real CA: N distinct identities asking at once, and a renewal
storm on top of it.

Run: `.venv/bin/python bench/storm.py [--identities 10000] [--in-flight 256] [--renewals 2000]
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

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parents[1] / "proto"),
]

from ca_server.dev_issuer import load_dev_issuer  # noqa: E402
from certs import SpiffeId, build_csr, generate_private_key  # noqa: E402
from meshca_proto import ca_pb2, ca_pb2_grpc  # noqa: E402
from tests.support.ca_process import CaProcess  # noqa: E402
from tests.support.metrics import sample_value  # noqa: E402
from tests.support.processes import child_env, stop_child, wait_for  # noqa: E402

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}
ATTEMPT_TIMEOUT = 10.0
CONNECTIONS = 16


@dataclass
class Outcome:
    renewal: bool
    latency: float | None = None  # first attempt to certificate; None when it never came
    hinted_refusals: int = 0
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


async def run_storm(
    ca: CaProcess, jobs: list[Job], in_flight: int, give_up_after: float
) -> tuple[list[Outcome], float]:
    credentials = grpc.ssl_channel_credentials(ca.root_cert_path.read_bytes())
    options = [("grpc.ssl_target_name_override", "localhost")]
    channels = [
        grpc.aio.secure_channel(ca.addr, credentials, options=options) for _ in range(CONNECTIONS)
    ]
    stubs = [ca_pb2_grpc.IstioCertificateServiceStub(channel) for channel in channels]
    for channel in channels:
        await channel.channel_ready()
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
    for channel in channels:
        await channel.close()
    return list(outcomes), wall


def _ms(values: list[float], q: int) -> str:
    if len(values) < 2:
        return "-"
    return f"{statistics.quantiles(values, n=100)[q - 1] * 1000:.0f} ms"


def report(outcomes: list[Outcome], wall: float, metrics: str) -> None:
    got = [o for o in outcomes if o.latency is not None]
    print(f"wall time {wall:.1f} s for {len(outcomes)} requests: {len(got) / wall:.0f} certs/s")
    print(f"failed (no certificate in the end): {len(outcomes) - len(got)}")
    print(f"refusals with a retry hint: {sum(o.hinted_refusals for o in outcomes)}")
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
    args = parser.parse_args()
    renewals = args.identities // 5 if args.renewals is None else args.renewals
    extra = []
    if args.workers is not None:
        extra += ["--workers", str(args.workers)]
    if args.max_in_flight is not None:
        extra += ["--max-in-flight", str(args.max_in_flight)]
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
            outcomes, wall = asyncio.run(run_storm(ca, jobs, args.in_flight, args.give_up_after))
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


if __name__ == "__main__":
    main()
