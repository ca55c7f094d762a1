"""Where one CA worker spends its time under load: a GIL profile split by request step.

Run: `.venv/bin/python -m bench.profile_ca [--duration 6] [--concurrency 8]`

Needs `py-spy` (`.venv/bin/pip install py-spy`; not a project dependency) and h2load (see
`bench/vs_cfssl.py`). It starts `meshca ca --workers 1` with a plugged-in P-256 root, drives it
with h2load exactly as `bench/vs_cfssl.py` does, samples the worker with
`py-spy record --gil` (only samples of a thread holding the GIL), and prints the share of
samples under each step of a request, attributed to the innermost step on the stack, and the
GIL-held CPU per certificate each step stands for (samples ÷ rate ÷ certificates).
Run it before and after a change to see what the change bought.

What it cannot see: work done without the GIL. cryptography releases it for the signature math
(the CSR's ECDSA verify, the leaf's signature: two threads verify ~1.9x as fast as one), and
grpc core's own threads, TLS and the kernel never hold it; so the process CPU per certificate
printed on the first line is larger than the sum of the steps, and a step that calls into the
signature math shows only its Python part. `bench/handler_cost.py --steps` times the steps with
the math included (in-process, no gRPC).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench.proc_cpu import cpu_seconds
from bench.vs_cfssl import Meshca, ensure_tools, write_pki

# (step, substrings of a py-spy frame "function (file:line)"); the innermost match wins.
STEPS: list[tuple[str, tuple[str, ...]]] = [
    ("metrics (prometheus_client)", ("prometheus_client/",)),
    ("audit line", ("meshca/logs.py", "logging/__init__.py", "json/")),
    ("CSR parse + verify", ("load_verified_csr (",)),
    ("leaf build + sign + PEM", ("sign (ca_server/authority/signer.py", "response_chain (")),
    ("strict checks (authz)", ("authorize_csr (",)),
    ("authentication", ("authenticate (",)),
    ("TTL / not_after", ("grant_validity (", "not_after (")),
    ("admission control", ("ca_server/admission.py",)),
    ("handler (rest)", ("CreateCertificate (", "_issue (ca_server/service.py", "_refuse (")),
    ("RPC server (cq_server)", ("ca_server/serving/cq_server.py",)),
]
MACHINERY = "gRPC + asyncio machinery"
_RATE = 250  # py-spy samples per second


def categorize(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for step, needles in STEPS:
            if any(needle in frame for needle in needles):
                return step
    return MACHINERY


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--keep", type=Path, default=None, help="copy py-spy's raw stacks here")
    parser.add_argument("--native", action="store_true", help="include C/C++/Rust frames")
    args = parser.parse_args()
    ensure_tools()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise SystemExit("needs py-spy: .venv/bin/pip install py-spy")
    with tempfile.TemporaryDirectory(prefix="meshca-profile-") as tmp:
        workdir = Path(tmp)
        write_pki(workdir)
        ca = Meshca(workdir, "meshca-1w", 1)
        try:
            load = threading.Thread(
                target=subprocess.run,
                args=(
                    [
                        "h2load",
                        "-c",
                        str(args.concurrency),
                        "-m",
                        "1",
                        "-D",
                        str(args.duration + 2),
                        *ca.h2load_args(args.concurrency),
                    ],
                ),
                kwargs={"stdout": subprocess.DEVNULL},
            )
            load.start()
            raw = workdir / "profile.txt"
            issued_before, cpu_before = ca.successes(), cpu_seconds(ca.pid)
            subprocess.run(
                [
                    py_spy,
                    "record",
                    "--gil",
                    *(["--native"] if args.native else []),
                    "--format",
                    "raw",
                    "--duration",
                    str(args.duration),
                    "--rate",
                    str(_RATE),
                    "--pid",
                    str(ca.pid),
                    "--output",
                    str(raw),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            issued, cpu = ca.successes() - issued_before, cpu_seconds(ca.pid) - cpu_before
            load.join()
        finally:
            ca.stop()
        if args.keep:
            shutil.copy(raw, args.keep)
        counts: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stack_text, _, count = line.rpartition(" ")
            counts[categorize(stack_text.split(";"))] += int(count)
    total = sum(counts.values()) or 1
    per_cert_us = cpu / issued * 1e6 if issued else float("nan")
    print(
        f"one worker at concurrency {args.concurrency}: {issued:.0f} certificates in "
        f"{args.duration} s, {per_cert_us:.0f} µs CPU each (the process); {total} GIL samples, "
        f"{total / _RATE / issued * 1e6 if issued else float('nan'):.0f} µs of it holding the GIL"
    )
    print(f"  {'step':30} {'share':>7} {'GIL µs':>8}")
    for step, _ in [*STEPS, (MACHINERY, ())]:
        share = counts[step] / total
        gil_us = counts[step] / _RATE / issued * 1e6 if issued else float("nan")
        print(f"  {step:30} {100 * share:6.1f}% {gil_us:8.0f}")


if __name__ == "__main__":
    main()
