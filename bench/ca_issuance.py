"""CA issuance throughput and latency, end to end over TLS gRPC, against in-process signing.

Run: `.venv/bin/python -m bench.ca_issuance [--requests 400] [--concurrency 1 8 32] [--workers N]`

It starts a real `meshca ca` process, then measures:
- baseline: the `certs` library signing a workload leaf in this process (the floor any CA pays);
- CreateCertificate over TLS with a cached token, at each concurrency level (grpc.aio client);
and prints requests/s, p50/p99 latency, and the ratio of each RPC figure to the baseline, so the
numbers compare within one run on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from certs import (
    SpiffeId,
    build_csr,
    build_root_certificate,
    build_workload_certificate,
    generate_private_key,
)
from meshca_proto import ca_pb2, ca_pb2_grpc
from tests.support.ca_process import CaProcess

IDENTITY = SpiffeId("cluster.local", "default", "bench")


def baseline_signing(count: int) -> float:
    """Leaves signed per second by the library alone (ECDSA P-256 root)."""
    now = datetime.now(UTC)
    root_key = generate_private_key()
    root = build_root_certificate(root_key, "cluster.local", now=now, lifetime=timedelta(days=1))
    public = generate_private_key().public_key()
    started = time.perf_counter()
    for _ in range(count):
        build_workload_certificate(
            public, IDENTITY, root, root_key, not_before=now, not_after=now + timedelta(hours=1)
        )
    return count / (time.perf_counter() - started)


async def rpc_run(
    ca: CaProcess, token: str, csrs: list[str], concurrency: int
) -> tuple[float, list[float]]:
    credentials = grpc.ssl_channel_credentials(ca.root_cert_path.read_bytes())
    latencies: list[float] = []
    queue = list(csrs)
    async with grpc.aio.secure_channel(
        ca.addr, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
        metadata = (("authorization", f"Bearer {token}"),)

        async def worker() -> None:
            while queue:
                csr = queue.pop()
                started = time.perf_counter()
                await stub.CreateCertificate(
                    ca_pb2.IstioCertificateRequest(csr=csr), metadata=metadata, timeout=30
                )
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return len(csrs) / elapsed, latencies


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--workers", type=int, default=1, help="CA workers (default 1)")
    args = parser.parse_args()

    base = baseline_signing(args.requests)
    print(f"baseline: in-process leaf signing          {base:8.0f} /s")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        ca = CaProcess(Path(tmp) / "data", "--workers", str(args.workers))
        ca.start()
        try:
            token = ca.mint_token(IDENTITY.namespace, IDENTITY.service_account)
            csrs = [build_csr(generate_private_key(), IDENTITY) for _ in range(args.requests)]
            asyncio.run(rpc_run(ca, token, csrs[:20], 4))  # warm up: connection, token cache
            for concurrency in args.concurrency:
                rate, latencies = asyncio.run(rpc_run(ca, token, list(csrs), concurrency))
                quantiles = statistics.quantiles(latencies, n=100)
                print(
                    f"CreateCertificate over TLS, concurrency {concurrency:3d}: {rate:8.0f} /s  "
                    f"p50 {quantiles[49] * 1000:6.2f} ms  p99 {quantiles[98] * 1000:6.2f} ms  "
                    f"ratio to baseline {rate / base:5.2f}"
                )
        finally:
            ca.stop()


if __name__ == "__main__":
    main()
