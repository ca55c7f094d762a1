"""API-server calls the CA makes per 1,000 certificates in Kubernetes mode: TokenReview vs offline.

Run: `.venv/bin/python -m bench.kube_api_calls [--pods 1000] [--concurrency 32]`

The fake API server (`tests/support/kube_api`, real HTTP, counting every request) holds `--pods`
running pods, each with its own projected service-account token (a real JWT signed by the
server's issuer key, also known to its TokenReview). For each mode a real `meshca ca
--kubeconfig ... --token-validation MODE` is started, then two rounds of CreateCertificate run
over TLS gRPC at `--concurrency`:
- first certificates: every pod's token once (all tokens new to the CA);
- renewals: the same tokens again (the CA's verified-token cache).
Per round it prints wall time, certificates/s and the API requests the round caused, per 1,000
certificates, broken down by verb and resource (long-lived watches included if one happened to
reconnect), and at the end the ratio of both modes' calls and throughput for first certificates.
TokenReview mode is paced by the CA's own client-side rate limit (`--kube-qps`, `--kube-burst`).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from certs import SpiffeId, build_csr, generate_private_key
from meshca_proto import ca_pb2, ca_pb2_grpc
from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer

NAMESPACE = "bench"
ACCOUNTS = 20
MODES = ("tokenreview", "offline")


@dataclass(frozen=True)
class Workload:
    token: str
    csr: str


@dataclass(frozen=True)
class Round:
    certificates: int
    seconds: float
    calls: dict[tuple[str, str], int]

    @property
    def calls_per_thousand(self) -> float:
        return sum(self.calls.values()) * 1000 / self.certificates


def seed(server: KubeApiServer, pods: int) -> list[Workload]:
    server.create_namespace("istio-system")
    server.create_namespace(NAMESPACE)
    workloads = []
    for index in range(pods):
        account = f"sa-{index % ACCOUNTS}"
        pod = f"app-{index}"
        server.create_pod(NAMESPACE, pod, service_account=account, node_name=f"node-{index % 10}")
        token = server.issue_service_account_token(
            NAMESPACE, account, audiences=["istio-ca"], pod_name=pod
        )
        csr = build_csr(generate_private_key(), SpiffeId("cluster.local", NAMESPACE, account))
        workloads.append(Workload(token, csr))
    return workloads


async def issue_all(ca: CaProcess, workloads: list[Workload], concurrency: int) -> int:
    credentials = grpc.ssl_channel_credentials(ca.root_cert_path.read_bytes())
    queue = list(workloads)
    failures: list[str] = []
    async with grpc.aio.secure_channel(
        ca.addr, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)

        async def worker() -> None:
            while queue:
                workload = queue.pop()
                try:
                    await stub.CreateCertificate(
                        ca_pb2.IstioCertificateRequest(csr=workload.csr),
                        metadata=(("authorization", f"Bearer {workload.token}"),),
                        timeout=120,
                    )
                except grpc.aio.AioRpcError as error:
                    failures.append(f"{error.code().name}: {error.details()}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return len(workloads)


def run_round(
    server: KubeApiServer, ca: CaProcess, workloads: list[Workload], concurrency: int
) -> Round:
    server.reset_counts()
    started = time.perf_counter()
    issued = asyncio.run(issue_all(ca, workloads, concurrency))
    seconds = time.perf_counter() - started
    return Round(issued, seconds, server.request_counts())


def describe(calls: dict[tuple[str, str], int], certificates: int) -> str:
    if not calls:
        return "none"
    return ", ".join(
        f"{verb} {resource} {count * 1000 / certificates:.0f}"
        for (verb, resource), count in sorted(calls.items())
    )


def measure(mode: str, args: argparse.Namespace) -> dict[str, Round]:
    with KubeApiServer() as server, tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        workloads = seed(server, args.pods)
        kubeconfig = server.write_kubeconfig(Path(tmp) / "kubeconfig")
        ca = CaProcess(
            Path(tmp) / "ca",
            "--kubeconfig",
            str(kubeconfig),
            "--no-root-configmaps",
            "--token-validation",
            mode,
            "--kube-qps",
            str(args.kube_qps),
            "--kube-burst",
            str(args.kube_burst),
        )
        ca.start(timeout=60)
        # Start-up traffic is not per certificate: let the CA open its long-lived watch of the
        # root Secret (it does so just after /ready) before counting.
        deadline = time.monotonic() + 10
        while server.count("watch", "secrets") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            rounds = {
                name: run_round(server, ca, workloads, args.concurrency)
                for name in ("first certificates", "renewals")
            }
        finally:
            ca.stop()
    for name, result in rounds.items():
        print(
            f"{mode:>11} {name:<18} {result.seconds:6.2f} s "
            f"{result.certificates / result.seconds:7.0f} certs/s  "
            f"API calls per 1,000 certs: {result.calls_per_thousand:6.0f} "
            f"({describe(result.calls, result.certificates)})"
        )
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000, help="distinct pods (and tokens)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kube-qps", type=float, default=50.0, help="the CA's default")
    parser.add_argument("--kube-burst", type=int, default=100, help="the CA's default")
    args = parser.parse_args()
    results = {mode: measure(mode, args) for mode in MODES}
    first = {mode: rounds["first certificates"] for mode, rounds in results.items()}
    review, offline = first["tokenreview"], first["offline"]
    print(
        f"first certificates: API calls per 1,000 — tokenreview {review.calls_per_thousand:.0f}, "
        f"offline {offline.calls_per_thousand:.0f}; throughput offline ÷ tokenreview "
        f"{(offline.certificates / offline.seconds) / (review.certificates / review.seconds):.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
