"""What stands between meshca and cfssl: the same stack doing less, measured in the same run.

Run: `.venv/bin/python -m bench.stack_ceiling [--duration 5] [--concurrency 8 32]
[--repetitions 3] [--single] [--compare-normal]`

`meshca ca` ÷ cfssl and what bounds it, measured on the machine it runs on with
`bench/vs_cfssl.py`'s load generator (h2load), root, CSR, token and server-side counting. The
floor servers (`bench/stack_floor_server.py`, N processes on one port) show what each layer of
the stack costs and what each change of issue 20 buys:

- `cfssl`: `cfssl serve`, as in `bench/vs_cfssl.py`;
- `noop-<rpc>-N`: a canned chain answered on each RPC layer — `aio` (`grpc.aio`), `sync`
  (`grpc.server`, 4 threads), `cq` (meshca's completion-queue server): what one RPC costs
  with nothing done (past a few thousand RPCs/s the single-threaded h2load is the limit, so
  read CPU per RPC);
- `sign-builder-aio-N`: CSR read + verify, leaf from `CertificateBuilder`, PEM, on `grpc.aio`:
  the ceiling this stack had before issue 20;
- `sign-<rpc>-N`: the same with the leaf from the DER template (the CA's signer) on each RPC
  layer: the fastest CA that could be written with this stack and that layer;
- `meshca-N`: `meshca ca` with its defaults (N workers, the completion-queue server);
  `meshca-N-aio`: the same with `--rpc-server aio`;
- with `--single`: `meshca-1`, `sign-cq-1` and `noop-cq-1` (one process), for N ÷ 1;
- `meshca-N-normal`, with `--compare-normal`: `meshca-N` with `--cpu-scheduling normal`.

N is meshca's default worker count. Contenders alternate within each repetition; medians of
the repetitions are printed: certs/s, p99, CPU per certificate (the server's processes), the
load generator's own CPU, each ÷ cfssl, and meshca ÷ sign-cq (how much of the stack's ceiling
meshca reaches). With `--single`, N ÷ 1 is bounded by the machine: the cores left once the
load generator has its share, over the cores one process uses on its own.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench.stack_floor_server import read_counters
from bench.vs_cfssl import (
    Cfssl,
    Contender,
    Meshca,
    Run,
    drive,
    ensure_tools,
    write_pki,
)
from ca_server.serving.workers import default_worker_count
from certs import (
    build_serving_certificate,
    cert_to_pem,
    generate_private_key,
    load_certs,
    load_private_key,
    private_key_to_pem,
)
from tests.support.processes import child_env, free_port, wait_for

RPC_LAYERS = ("aio", "sync", "cq")


class FloorServers(Contender):
    """N copies of `bench/stack_floor_server.py` on one port, children of one shell so the
    bench reads their CPU as one tree (as it does for meshca's supervisor and workers)."""

    def __init__(self, workdir: Path, handler: str, rpc: str, processes: int, token: str) -> None:
        self.name = f"{handler}-{rpc}-{processes}"
        self.port = free_port()
        self._token = token
        self._body = workdir / f"meshca-{default_worker_count()}-body.grpc"  # any meshca body
        self._counters = workdir / f"{self.name}.counters"
        self._counters.write_bytes(bytes(8 * processes))
        ready = [workdir / f"{self.name}.ready{slot}" for slot in range(processes)]
        command = " & ".join(
            " ".join(
                [
                    sys.executable,
                    "-m bench.stack_floor_server",
                    f"--port {self.port} --handler {handler} --rpc {rpc}",
                    f"--cert {workdir / 'serving.crt'} --key {workdir / 'serving.key'}",
                    f"--root {workdir / 'ca.pem'} --root-key {workdir / 'ca-key.pem'}",
                    f"--sample-csr {workdir / 'request.csr'}",
                    f"--counters {self._counters} --slot {slot} --ready {ready[slot]}",
                ]
            )
            for slot in range(processes)
        )
        self._log = open(workdir / f"{self.name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            ["sh", "-c", f"{command} & wait"],
            env=child_env(),  # the source tree on PYTHONPATH: `-m bench...` from any directory
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,
        )
        self.pid = self._proc.pid
        wait_for(lambda: self._started(ready), 60, f"{self.name} ready")

    def _started(self, ready: list[Path]) -> bool:
        if self._proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited; see its log")
        return all(path.exists() for path in ready)

    def h2load_args(self, concurrency: int) -> list[str]:
        return [
            "-d",
            str(self._body),
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "-H",
            f"authorization: Bearer {self._token}",
            f"https://127.0.0.1:{self.port}/istio.v1.auth.IstioCertificateService/CreateCertificate",
        ]

    def successes(self) -> float:
        return float(read_counters(self._counters))

    def stop(self) -> None:
        os.killpg(self._proc.pid, signal.SIGTERM)
        self._proc.wait(15)
        self._log.close()


def write_serving_pki(workdir: Path) -> None:
    """A serving certificate for the floor servers from the bench's root, as meshca issues
    its own."""
    root = load_certs((workdir / "ca.pem").read_bytes(), what="bench root")[0]
    root_key = load_private_key((workdir / "ca-key.pem").read_bytes())
    key = generate_private_key()
    serving = build_serving_certificate(
        key.public_key(),
        root,
        root_key,
        hosts=["127.0.0.1"],
        now=datetime.now(UTC),
        lifetime=timedelta(days=1),
    )
    (workdir / "serving.crt").write_text(cert_to_pem(serving))
    (workdir / "serving.key").write_bytes(private_key_to_pem(key))


@dataclass
class Measured:
    run: Run
    load_cores: float  # the load generator's CPU over the run


def measure(contender: Contender, concurrency: int, duration: int, workdir: Path) -> Measured:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    run = drive(contender, concurrency, duration, workdir)
    elapsed = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Measured(run, load / elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=5, help="seconds per h2load run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--compare-normal", action="store_true", help="add meshca-N with --cpu-scheduling normal"
    )
    parser.add_argument(
        "--single", action="store_true", help="add one-process contenders (N ÷ 1 and its bound)"
    )
    args = parser.parse_args()
    ensure_tools()
    workers = default_worker_count()
    with tempfile.TemporaryDirectory(prefix="meshca-ceiling-") as tmp:
        workdir = Path(tmp)
        write_pki(workdir)
        write_serving_pki(workdir)
        meshca = Meshca(workdir, f"meshca-{workers}", workers)
        contenders: list[Contender] = [Cfssl(workdir), meshca]
        try:
            token = meshca.token
            contenders += [
                Meshca(workdir, f"meshca-{workers}-aio", workers, ("--rpc-server", "aio")),
                *(FloorServers(workdir, "noop", rpc, workers, token) for rpc in RPC_LAYERS),
                FloorServers(workdir, "sign-builder", "aio", workers, token),
                *(FloorServers(workdir, "sign", rpc, workers, token) for rpc in RPC_LAYERS),
            ]
            if args.single:
                contenders += [
                    Meshca(workdir, "meshca-1", 1),
                    FloorServers(workdir, "noop", "cq", 1, token),
                    FloorServers(workdir, "sign", "cq", 1, token),
                ]
            if args.compare_normal:
                contenders.append(
                    Meshca(
                        workdir,
                        f"meshca-{workers}-normal",
                        workers,
                        ("--cpu-scheduling", "normal"),
                    )
                )
            results: dict[tuple[str, int], list[Measured]] = {}
            for contender in contenders:  # warm up: connections, token cache, imports
                drive(contender, 4, 1, workdir)
            for repetition in range(args.repetitions):
                for concurrency in args.concurrency:
                    order = contenders if repetition % 2 == 0 else contenders[::-1]
                    for contender in order:
                        measured = measure(contender, concurrency, args.duration, workdir)
                        results.setdefault((contender.name, concurrency), []).append(measured)
        finally:
            for contender in contenders:
                contender.stop()
    report(results, args.concurrency, [c.name for c in contenders], workers, args.repetitions)


def report(
    results: dict[tuple[str, int], list[Measured]],
    levels: list[int],
    names: list[str],
    workers: int,
    repetitions: int,
) -> None:
    def median(name: str, level: int, field: str) -> float:
        if field == "load_cores":
            return statistics.median(m.load_cores for m in results[(name, level)])
        return statistics.median(getattr(m.run, field) for m in results[(name, level)])

    def cores(name: str, level: int) -> float:
        """CPUs' worth of time the server used (its certs/s times CPU per certificate)."""
        return statistics.median(
            m.run.certs_per_second * m.run.cpu_ms_per_cert / 1000 for m in results[(name, level)]
        )

    print(f"medians of {repetitions} repetitions; N = {workers} (meshca's default workers)")
    print(
        f"{'server':16} {'c':>3} {'certs/s':>9} {'÷ cfssl':>8} {'p99 ms':>8} "
        f"{'CPU µs/cert':>12} {'server cores':>13} {'h2load cores':>13} {'failed':>7}"
    )
    for level in levels:
        cfssl = median("cfssl", level, "certs_per_second")
        for name in names:
            rate = median(name, level, "certs_per_second")
            print(
                f"{name:16} {level:3d} {rate:9.0f} {rate / cfssl:8.2f} "
                f"{median(name, level, 'p99_ms'):8.2f} "
                f"{1000 * median(name, level, 'cpu_ms_per_cert'):12.0f} "
                f"{cores(name, level):13.2f} {median(name, level, 'load_cores'):13.2f} "
                f"{max(m.run.failed for m in results[(name, level)]):7d}"
            )
        print()
    cpus = os.cpu_count() or 1
    for level in levels:
        rates = {name: median(name, level, "certs_per_second") for name in names}
        cpu = {name: 1000 * median(name, level, "cpu_ms_per_cert") for name in names}
        print(f"c={level}:")
        print(
            "  one RPC, CPU µs: "
            + ", ".join(f"{rpc} {cpu[f'noop-{rpc}-{workers}']:.0f}" for rpc in RPC_LAYERS)
        )
        print(
            "  sign floor ÷ cfssl: "
            + f"builder+aio {rates[f'sign-builder-aio-{workers}'] / rates['cfssl']:4.2f}, "
            + ", ".join(
                f"template+{rpc} {rates[f'sign-{rpc}-{workers}'] / rates['cfssl']:4.2f}"
                for rpc in RPC_LAYERS
            )
        )
        print(
            f"  meshca ÷ cfssl {rates[f'meshca-{workers}'] / rates['cfssl']:4.2f} "
            f"(aio {rates[f'meshca-{workers}-aio'] / rates['cfssl']:4.2f}); "
            f"meshca ÷ sign-cq {rates[f'meshca-{workers}'] / rates[f'sign-cq-{workers}']:4.2f}; "
            f"CPU/cert meshca ÷ cfssl {cpu[f'meshca-{workers}'] / cpu['cfssl']:4.2f}"
        )
        if "meshca-1" not in rates:
            continue
        for kind in ("noop-cq", "sign-cq", "meshca"):
            one, many = f"{kind}-1", f"{kind}-{workers}"
            # Perfect scaling: N processes share what the load generator leaves of the
            # machine, each as efficient as one process on its own.
            load = median(many, level, "load_cores")
            bound = min(workers, (cpus - load) / cores(one, level))
            print(
                f"  {kind:8} {workers} ÷ 1 = {rates[many] / rates[one]:4.2f}   (machine bound "
                f"{bound:4.2f}: {cpus} CPUs - h2load {load:.2f}, over one process's "
                f"{cores(one, level):.2f} cores)"
            )


if __name__ == "__main__":
    main()
