"""meshca's CA against cfssl, side by side, with the same load generator, root key and CSR.

Run: `.venv/bin/python -m bench.vs_cfssl [--duration 5] [--concurrency 1 8 32] [--repetitions 3]
[--compare-aio]`

Needs Debian's `golang-cfssl` (cfssl 1.2) and `nghttp2-client` (h2load). As root with apt-get
it installs them itself; otherwise it prints the command to run
(`apt-get update && apt-get install -y golang-cfssl nghttp2-client`).

What it does, in one run so the figures compare on a shared, noisy machine:
- one ECDSA P-256 root (key + self-signed certificate), given to cfssl as `-ca/-ca-key` and to
  meshca as a plugged-in CA (`--cacerts-dir`, `tls.crt tls.key ca.crt`);
- one CSR for `spiffe://cluster.local/ns/default/sa/bench`, sent by `h2load` to
  - `cfssl serve` as the JSON body of `POST /api/v1/cfssl/sign` (HTTP/1.1, no TLS, no
    authentication: cfssl checks far less than meshca);
  - `meshca ca` (default workers, and `--workers 1` as the single-worker baseline) as a
    gRPC-framed `IstioCertificateRequest` over TLS HTTP/2, with a development token (cached
    by the CA after the first request) in the `authorization` header;
- each contender at each concurrency (h2load clients, one stream each), alternating contenders
  within each repetition; the median of the repetitions is printed.

Successes are counted on the server side: h2load counts HTTP 200 even when the gRPC status is
not OK, so meshca's issuances are read from its `/metrics` before and after each run (cfssl
answers a failed signing with a non-2xx HTTP status). CPU per certificate is the server's CPU
time (all its processes) over the run divided by the certificates issued; p50/p99 come from
h2load's per-request log. h2load runs on the same 2 cores, so absolute figures understate both
servers; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench.proc_cpu import cpu_seconds
from certs import (
    SpiffeId,
    build_csr,
    build_root_certificate,
    cert_to_pem,
    generate_private_key,
    private_key_to_pem,
)
from meshca_proto import ca_pb2
from tests.support.ca_process import mint_token
from tests.support.metrics import sample_value
from tests.support.processes import child_env, free_port, wait_for

IDENTITY = SpiffeId("cluster.local", "default", "bench")
GRPC_PATH = "/istio.v1.auth.IstioCertificateService/CreateCertificate"
INSTALL = "apt-get update && apt-get install -y golang-cfssl nghttp2-client"
CFSSL_CONFIG = {
    "signing": {
        "default": {
            "expiry": "24h",
            "usages": ["digital signature", "key encipherment", "server auth", "client auth"],
        }
    }
}


def ensure_tools() -> None:
    """cfssl and h2load on PATH, installed from Debian when we can; else say how, and stop."""
    if shutil.which("cfssl") and shutil.which("h2load"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"installing the load generator and cfssl: {INSTALL}", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], check=True, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(
            ["apt-get", "install", "-y", "golang-cfssl", "nghttp2-client"],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
    if not (shutil.which("cfssl") and shutil.which("h2load")):
        raise SystemExit(
            f"bench/vs_cfssl.py needs cfssl and h2load; install them with:\n  {INSTALL}"
        )


@dataclass
class Run:
    certs_per_second: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_cert: float
    failed: int


class Contender:
    name: str
    pid: int

    def h2load_args(self, concurrency: int) -> list[str]:
        raise NotImplementedError

    def successes(self) -> float:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class Cfssl(Contender):
    def __init__(self, workdir: Path) -> None:
        self.name = "cfssl"
        self.port = free_port()
        (workdir / "cfssl.json").write_text(json.dumps(CFSSL_CONFIG))
        csr = (workdir / "request.csr").read_text()
        (workdir / "cfssl-body.json").write_text(json.dumps({"certificate_request": csr}))
        self._body = workdir / "cfssl-body.json"
        self._log = open(workdir / "cfssl.log", "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [
                "cfssl",
                "serve",
                "-address",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-ca",
                str(workdir / "ca.pem"),
                "-ca-key",
                str(workdir / "ca-key.pem"),
                "-config",
                str(workdir / "cfssl.json"),
                "-loglevel",
                "5",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.pid = self._proc.pid
        wait_for(lambda: _port_open(self.port), 30, "cfssl serve")
        self.counted = 0

    def h2load_args(self, concurrency: int) -> list[str]:
        return [
            "--h1",
            "-d",
            str(self._body),
            "-H",
            "content-type: application/json",
            f"http://127.0.0.1:{self.port}/api/v1/cfssl/sign",
        ]

    def successes(self) -> float:
        return float(self.counted)  # from h2load's log: cfssl answers failures with non-2xx

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)
        self._log.close()


class Meshca(Contender):
    def __init__(
        self,
        workdir: Path,
        name: str,
        workers: int | None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`extra_args` are added to `meshca ca`'s (`bench/stack_ceiling.py` compares
        `--cpu-scheduling normal`)."""
        self.name = name
        self.port = free_port()
        self.monitoring_port = free_port()
        data_dir = workdir / f"{name}-data"
        args = [
            sys.executable,
            "-m",
            "meshca",
            "ca",
            "--data-dir",
            str(data_dir),
            "--cacerts-dir",
            str(workdir / "cacerts"),
            "--dev-issuer",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--monitoring-listen",
            f"127.0.0.1:{self.monitoring_port}",
            "--log-level",
            "WARNING",
        ]
        if workers is not None:
            args += ["--workers", str(workers)]
        args += extra_args
        self._log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        # Audit lines are part of the cost of an issuance: written, but not kept.
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=self._log, env=child_env()
        )
        self.pid = self._proc.pid
        wait_for(self._ready, 60, f"{name} /ready")
        token = mint_token(data_dir, IDENTITY.namespace, IDENTITY.service_account, ttl="24h")
        self.token = token
        request = ca_pb2.IstioCertificateRequest(csr=(workdir / "request.csr").read_text())
        payload = request.SerializeToString()
        self._body = workdir / f"{name}-body.grpc"
        self._body.write_bytes(b"\x00" + len(payload).to_bytes(4, "big") + payload)

    def _ready(self) -> bool:
        if self._proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited; see its log")
        try:
            url = f"http://127.0.0.1:{self.monitoring_port}/ready"
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def h2load_args(self, concurrency: int) -> list[str]:
        return [
            "-d",
            str(self._body),
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "-H",
            f"authorization: Bearer {self.token}",
            f"https://127.0.0.1:{self.port}{GRPC_PATH}",
        ]

    def successes(self) -> float:
        url = f"http://127.0.0.1:{self.monitoring_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sample_value(text, "citadel_server_success_cert_issuance_count")

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(15)
        self._log.close()


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def write_pki(workdir: Path) -> None:
    """One P-256 root for both CAs, and one CSR for both load generators."""
    now = datetime.now(UTC)
    key = generate_private_key()
    root = build_root_certificate(key, "cluster.local", now=now, lifetime=timedelta(days=30))
    (workdir / "ca.pem").write_text(cert_to_pem(root))
    (workdir / "ca-key.pem").write_bytes(private_key_to_pem(key))
    cacerts = workdir / "cacerts"
    cacerts.mkdir()
    (cacerts / "tls.crt").write_text(cert_to_pem(root))
    (cacerts / "tls.key").write_bytes(private_key_to_pem(key))
    (cacerts / "ca.crt").write_text(cert_to_pem(root))
    (workdir / "request.csr").write_text(build_csr(generate_private_key(), IDENTITY))


def drive(contender: Contender, concurrency: int, duration: int, workdir: Path) -> Run:
    log_file = workdir / "h2load-requests.log"
    log_file.unlink(missing_ok=True)  # h2load appends
    before = contender.successes()
    cpu_before = cpu_seconds(contender.pid)
    started = time.monotonic()
    subprocess.run(
        [
            "h2load",
            "-c",
            str(concurrency),
            "-m",
            "1",
            "-D",
            str(duration),
            "--log-file",
            str(log_file),
            *contender.h2load_args(concurrency),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    elapsed = time.monotonic() - started
    cpu = cpu_seconds(contender.pid) - cpu_before
    latencies, ok_http, total = _read_h2load_log(log_file)
    if isinstance(contender, Cfssl):
        contender.counted += ok_http
    issued = contender.successes() - before
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return Run(
        certs_per_second=issued / elapsed,
        p50_ms=quantiles[49],
        p99_ms=quantiles[98],
        cpu_ms_per_cert=cpu * 1000 / issued if issued else float("nan"),
        failed=max(0, int(total - issued)),
    )


def _read_h2load_log(path: Path) -> tuple[list[float], int, int]:
    """Latencies (ms) of every request, the HTTP 2xx count and the total, from h2load's log
    (tab-separated: start time µs, HTTP status, duration µs)."""
    latencies = []
    ok = 0
    total = 0
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 3:
            continue
        total += 1
        status = int(fields[1])
        ok += 200 <= status < 300
        latencies.append(int(fields[2]) / 1000)
    return latencies, ok, total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=5, help="seconds per h2load run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--workers", type=int, default=None, help="meshca workers (default: meshca's default)"
    )
    parser.add_argument(
        "--compare-aio",
        action="store_true",
        help="add meshca-aio: the default workers on grpc.aio's server (--rpc-server aio)",
    )
    args = parser.parse_args()
    ensure_tools()
    with tempfile.TemporaryDirectory(prefix="meshca-vs-cfssl-") as tmp:
        workdir = Path(tmp)
        write_pki(workdir)
        contenders: list[Contender] = [
            Cfssl(workdir),
            Meshca(workdir, "meshca", args.workers),
            Meshca(workdir, "meshca-1w", 1),
        ]
        if args.compare_aio:
            contenders.append(Meshca(workdir, "meshca-aio", args.workers, ("--rpc-server", "aio")))
        try:
            results: dict[tuple[str, int], list[Run]] = {}
            for contender in contenders:  # warm up: connections, token cache, imports
                drive(contender, 4, 1, workdir)
            for repetition in range(args.repetitions):
                for concurrency in args.concurrency:
                    order = contenders if repetition % 2 == 0 else contenders[::-1]
                    for contender in order:
                        run = drive(contender, concurrency, args.duration, workdir)
                        results.setdefault((contender.name, concurrency), []).append(run)
        finally:
            for contender in contenders:
                contender.stop()
    report(results, args.concurrency, [c.name for c in contenders], args.repetitions)


def report(
    results: dict[tuple[str, int], list[Run]],
    levels: list[int],
    names: list[str],
    repetitions: int,
) -> None:
    def median(name: str, level: int, field: str) -> float:
        return statistics.median(getattr(run, field) for run in results[(name, level)])

    print(f"medians of {repetitions} repetitions; certs/s counted on the server side")
    print(
        f"{'server':10} {'c':>3} {'certs/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'CPU ms/cert':>12} {'failed':>7}"
    )
    for level in levels:
        for name in names:
            print(
                f"{name:10} {level:3d} {median(name, level, 'certs_per_second'):9.0f} "
                f"{median(name, level, 'p50_ms'):8.2f} {median(name, level, 'p99_ms'):8.2f} "
                f"{median(name, level, 'cpu_ms_per_cert'):12.2f} "
                f"{max(run.failed for run in results[(name, level)]):7d}"
            )
    print()
    print(f"{'c':>3} {'meshca ÷ cfssl':>15} {'meshca-1w ÷ cfssl':>18} {'meshca ÷ meshca-1w':>19}")
    for level in levels:
        meshca = median("meshca", level, "certs_per_second")
        single = median("meshca-1w", level, "certs_per_second")
        cfssl = median("cfssl", level, "certs_per_second")
        print(f"{level:3d} {meshca / cfssl:15.2f} {single / cfssl:18.2f} {meshca / single:19.2f}")
    for level in levels:
        cpu = {name: median(name, level, "cpu_ms_per_cert") for name in names}
        p99 = {name: median(name, level, "p99_ms") for name in names}
        print(
            f"c={level}: CPU per certificate ÷ cfssl's: "
            + ", ".join(f"{name} {cpu[name] / cpu['cfssl']:.2f}" for name in names[1:])
            + "; p99 ÷ cfssl's: "
            + ", ".join(f"{name} {p99[name] / p99['cfssl']:.2f}" for name in names[1:])
        )
        if "meshca-aio" in names:
            rate = median("meshca-aio", level, "certs_per_second")
            cfssl = median("cfssl", level, "certs_per_second")
            print(f"c={level}: meshca-aio ÷ cfssl {rate / cfssl:.2f}")


if __name__ == "__main__":
    main()
