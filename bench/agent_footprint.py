"""The agent's footprint: start → first SDS secret, and resident memory, sidecar and node mode.

Run: `.venv/bin/python -m bench.agent_footprint [--repetitions 3] [--node-identities 100 1000]`

Everything is real: a `meshca ca` process, `python -m meshca agent ...` processes launched as a
pod would, and an SDS client (gRPC `FetchSecrets` over the agent's Unix socket) that polls from
the instant of launch. Figures (medians over `--repetitions`):
- start → first secret: from `Popen` to the SDS answer holding the certificate (sidecar:
  `default`; node mode: the first identity of the static list);
- node mode, start → all: until one `FetchSecrets` returns every identity's certificate;
- RSS: the agent's resident memory (VmRSS) right after that, its anonymous part (RssAnon: the
  rest is file-backed, mostly the grpc and cryptography native libraries) and its peak (VmHWM);
- PSS: its proportional set size (`smaps_rollup`), where a page shared with other processes
  counts for its share. With `--together N` (default 4), N sidecars are also started at the
  same instant, as on a node running N pods of one image: their PSS is what one more pod
  costs the node, since the libraries' file-backed pages are then shared.
The sidecar is started twice per repetition: through the `meshca agent` CLI, as deployed, and as
`python -m agent.main` (the agent's own entry), which separates what the CLI imports from what
the agent itself needs.
Baselines in the same run: a bare interpreter (`python -c pass`), the floor no Python agent
speaking gRPC and doing X.509 can go below (`import asyncio, grpc.aio, cryptography.x509`), a
minimal program doing the least a sidecar does with those libraries (`MINIMAL_PROGRAM`: a gRPC
server on a Unix socket, a key and CSR, one TLS call to the CA; no messages, metrics or SDS),
and one importing the sidecar's modules (`import agent.main`), so the ratios show what the agent
adds on top of Python and its two native libraries. A baseline's time is until its code has run;
its memory is read from /proc while it waits, before it exits.
`--agent-env NAME=VALUE` (repeatable) adds a sidecar started with that variable (an allocator or
gRPC knob: `MALLOC_ARENA_MAX=1`, `GRPC_POLL_STRATEGY=poll`...) and prints its change against the
plain sidecar of the same run.
Last, where the RSS is (`bench.proc_memory`): anonymous and file-backed MiB per group of mappings
(grpc, cryptography, libpython, OpenSSL, malloc's heap, Python's object arenas...) for the
baselines and the sidecar, and the sidecar minus the minimal program: what the agent itself adds.
The project is byte-compiled first (`compileall`, as a wheel install does).
Node mode needs a CA in Kubernetes mode (its node authorizer): the fake API server holds a pod
of every listed service account on the node, and the CA trusts the node agent's account.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.proc_memory import (
    GROUP_NAMES,
    Resident,
    memory_by_mapping,
    pss_mib,
    status_mib,
    total,
)
from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer
from tests.support.processes import child_env, free_port, stop_child
from tests.support.sds_client import fetch_secrets

CA_NAMESPACE = "istio-system"
NODE = "node-a"


@dataclass(frozen=True)
class Footprint:
    first_secret_ms: float
    all_secrets_ms: float
    rss_mib: float
    anon_mib: float  # RssAnon: the process's own memory (the rest maps shared libraries)
    peak_rss_mib: float
    pss_mib: float  # proportional set size: shared pages count for their share
    mappings: dict[str, Resident]  # where the RSS is (`bench.proc_memory.GROUP_NAMES`)


@dataclass(frozen=True)
class Baseline:
    """A fresh interpreter that ran some code: how long that took, and its memory then."""

    ms: float
    rss_mib: float
    mappings: dict[str, Resident]


def wait_for_secrets(socket: Path, names: list[str], deadline: float) -> None:
    """Polls until one `FetchSecrets` answers with all `names` (the socket may not exist yet)."""
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no SDS answer for {names[:2]}... in time")
        if socket.exists():
            try:
                if len(fetch_secrets(socket, names)) == len(names):
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.002)


# How the agent process is started: the `meshca` CLI as deployed, or the agent's own module.
CLI = ("meshca", "agent")
AGENT_MODULE = ("agent.main",)


def run_agent(
    args: list[str],
    socket: Path,
    first: list[str],
    every: list[str],
    log: Path,
    entry: tuple[str, ...] = CLI,
    env: dict[str, str] | None = None,
) -> Footprint:
    with log.open("wb") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", *entry, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(env),
        )
        try:
            wait_for_secrets(socket, first, started + 60)
            first_ms = (time.monotonic() - started) * 1000
            wait_for_secrets(socket, every, started + 300)
            all_ms = (time.monotonic() - started) * 1000
            rss, anon, peak = status_mib(proc.pid)
            pss = pss_mib(proc.pid)
            mappings = memory_by_mapping(proc.pid)
        except BaseException:
            print(log.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            stop_child(proc)
    return Footprint(first_ms, all_ms, rss, anon, peak, pss, mappings)


def common_args(ca: CaProcess, directory: Path, token: str) -> list[str]:
    (directory / "token").write_text(token)
    return [
        "--ca-addr", ca.addr,
        "--ca-root", str(ca.root_cert_path),
        "--token-file", str(directory / "token"),
        "--sds-socket", str(directory / "sds.sock"),
        "--status-listen", f"127.0.0.1:{free_port()}",
        "--secret-ttl", "1h",
        "--log-level", "WARNING",
    ]  # fmt: skip


def sidecar(
    ca: CaProcess,
    workdir: Path,
    name: str,
    entry: tuple[str, ...],
    env: dict[str, str] | None = None,
) -> Footprint:
    directory = workdir / name
    directory.mkdir()
    args = common_args(ca, directory, ca.mint_token("default", "bench"))
    args += ["--namespace", "default", "--service-account", "bench"]
    socket = directory / "sds.sock"
    log = directory / "agent.log"
    return run_agent(args, socket, ["default"], ["default"], log, entry, env)


def environment_variant(text: str) -> tuple[str, str]:
    """`--agent-env NAME=VALUE` as (NAME, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def sidecars_together(ca: CaProcess, workdir: Path, run: int, count: int) -> list[Footprint]:
    """`count` sidecars (through the CLI) launched at the same instant; each one's figures once
    every one of them serves its secret (so PSS sees all of them sharing the libraries)."""
    launched = []
    for index in range(count):
        directory = workdir / f"together-{run}-{index}"
        directory.mkdir()
        args = common_args(ca, directory, ca.mint_token("default", f"bench-{index}"))
        args += ["--namespace", "default", "--service-account", f"bench-{index}"]
        launched.append((directory, args))
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    started = time.monotonic()
    try:
        for directory, args in launched:
            with (directory / "agent.log").open("wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", *CLI, *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=child_env(),
                )
            procs.append((proc, directory))
        first: list[float] = []
        for _, directory in procs:
            wait_for_secrets(directory / "sds.sock", ["default"], started + 60)
            first.append((time.monotonic() - started) * 1000)
        results = []
        for (proc, _), first_ms in zip(procs, first, strict=True):
            rss, anon, peak = status_mib(proc.pid)
            pss, mappings = pss_mib(proc.pid), memory_by_mapping(proc.pid)
            results.append(Footprint(first_ms, first_ms, rss, anon, peak, pss, mappings))
        return results
    finally:
        for proc, _ in procs:
            stop_child(proc)


def node_setup(server: KubeApiServer, identities: int) -> list[str]:
    """Pods of `identities` service accounts on NODE; returns the static list `ns/sa`."""
    accounts = [f"sa-{index}" for index in range(identities)]
    for account in accounts:
        server.create_pod("bench", f"{account}-pod", service_account=account, node_name=NODE)
    return [f"bench/{account}" for account in accounts]


def node_agent(ca: CaProcess, token: str, listed: list[str], workdir: Path, run: int) -> Footprint:
    directory = workdir / f"node-{len(listed)}-{run}"
    directory.mkdir()
    identities_file = directory / "identities"
    identities_file.write_text("\n".join(listed) + "\n")
    args = common_args(ca, directory, token)
    args += ["--node-mode", "--identities-file", str(identities_file)]
    names = [f"spiffe://cluster.local/ns/{entry.replace('/', '/sa/')}" for entry in listed]
    socket = directory / "sds.sock"
    return run_agent(args, socket, names[:1], names, directory / "agent.log")


def interpreter_baseline(code: str) -> Baseline:
    """A fresh interpreter running `code`: wall time until `code` has run, and its memory then,
    read from /proc while it waits (so reading its smaps costs it nothing)."""
    probe = f"{code}\nimport sys\nprint('ran', flush=True)\nsys.stdin.read()"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", probe],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ran = proc.stdout.readline()
        ms = (time.monotonic() - started) * 1000
        if ran != "ran\n":
            proc.kill()
            raise RuntimeError(f"baseline {code[:40]!r} failed:\n{proc.communicate()[1]}")
        rss, _, _ = status_mib(proc.pid)
        mappings = memory_by_mapping(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(30)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline {code[:40]!r} exited with {proc.returncode}")
    return Baseline(ms, rss, mappings)


def median_of(runs: list[Footprint], field: Callable[[Footprint], float]) -> float:
    return statistics.median(field(run) for run in runs)


REPO = Path(__file__).resolve().parents[1]
# What any Python agent speaking gRPC (with TLS) and doing X.509 has to load.
FLOOR = "import asyncio, grpc.aio, cryptography.x509"
# The least a sidecar does with them, and nothing else (no protobuf messages, no metrics, no
# SDS types): a gRPC server on a Unix socket answering one call, a P-256 key and its CSR, one
# TLS call to the CA (an unknown method: the handshake is what counts).
MINIMAL_PROGRAM = """
import asyncio, tempfile, grpc, grpc.aio
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

async def main(addr, root):
    directory = tempfile.TemporaryDirectory(dir="/tmp")
    async def echo(request, context):
        return request
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{directory.name}/s")
    await server.start()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    async with grpc.aio.insecure_channel(f"unix:{directory.name}/s") as channel:
        await channel.unary_unary("/bench.Echo/Echo")(csr.tbs_certrequest_bytes)
    credentials = grpc.ssl_channel_credentials(open(root, "rb").read())
    async with grpc.aio.secure_channel(addr, credentials) as channel:
        try:
            await channel.unary_unary("/bench.Unknown/Call")(b"", timeout=5)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNIMPLEMENTED, exc
    await server.stop(None)
    directory.cleanup()
"""


def precompile() -> None:
    """Byte-compile the project, as installing its wheel does. Without this, a checkout run
    with PYTHONDONTWRITEBYTECODE compiles every project module from source at each start (tens
    of milliseconds that no installed agent pays)."""
    packages = [str(REPO / name) for name in ("agent", "certs", "meshca", "ca_server", "proto")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--node-identities", type=int, nargs="*", default=[100, 1000])
    parser.add_argument(
        "--together", type=int, default=4, help="sidecars started at once for PSS (0: none)"
    )
    parser.add_argument(
        "--agent-env",
        type=environment_variant,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also run the sidecar (CLI) with this environment variable set, and compare it with "
        "the plain sidecar of the same run (repeatable: one variant each; e.g. MALLOC_ARENA_MAX=1)",
    )
    args = parser.parse_args()
    precompile()
    results: dict[str, list[Footprint]] = {}
    baselines: dict[str, list[Baseline]] = {
        "python -c pass": [],
        "grpc+cryptography floor": [],
        "minimal gRPC+X.509 program": [],
        "import agent.main": [],
    }
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="fp-") as tmp:
        workdir = Path(tmp)
        ca = CaProcess(workdir / "ca")
        ca.start()
        ca_root = str(ca.root_cert_path)
        try:
            for run in range(args.repetitions):
                baselines["python -c pass"].append(interpreter_baseline("pass"))
                baselines["grpc+cryptography floor"].append(interpreter_baseline(FLOOR))
                baselines["import agent.main"].append(interpreter_baseline("import agent.main"))
                minimal = f"{MINIMAL_PROGRAM}\nasyncio.run(main({ca.addr!r}, {ca_root!r}))"
                baselines["minimal gRPC+X.509 program"].append(interpreter_baseline(minimal))
                results.setdefault("sidecar (meshca agent)", []).append(
                    sidecar(ca, workdir, f"sidecar-cli-{run}", CLI)
                )
                results.setdefault("sidecar (-m agent.main)", []).append(
                    sidecar(ca, workdir, f"sidecar-module-{run}", AGENT_MODULE)
                )
                for index, (name, value) in enumerate(args.agent_env):
                    results.setdefault(f"sidecar, {name}={value}", []).append(
                        sidecar(ca, workdir, f"sidecar-env-{index}-{run}", CLI, {name: value})
                    )
                if args.together > 0:
                    results.setdefault(f"{args.together} sidecars at once", []).extend(
                        sidecars_together(ca, workdir, run, args.together)
                    )
        finally:
            ca.stop()
        if args.node_identities:
            with KubeApiServer() as server:
                server.create_namespace(CA_NAMESPACE)
                server.create_namespace("bench")
                server.create_pod(
                    CA_NAMESPACE, "node-agent-a", service_account="node-agent", node_name=NODE
                )
                token = server.issue_service_account_token(
                    CA_NAMESPACE, "node-agent", audiences=["istio-ca"], pod_name="node-agent-a"
                )
                listed = node_setup(server, max(args.node_identities))
                kube_ca = CaProcess(
                    workdir / "kube-ca",
                    "--kubeconfig", str(server.write_kubeconfig(workdir / "kubeconfig")),
                    "--no-root-configmaps",
                    "--trusted-node-accounts", f"{CA_NAMESPACE}/node-agent",
                )  # fmt: skip
                kube_ca.start(timeout=60)
                try:
                    for run in range(args.repetitions):
                        for count in args.node_identities:
                            results.setdefault(f"node, {count} identities", []).append(
                                node_agent(kube_ca, token, listed[:count], workdir, run)
                            )
                finally:
                    kube_ca.stop()

    floor_ms = statistics.median(sample.ms for sample in baselines["python -c pass"])
    floor_mib = statistics.median(sample.rss_mib for sample in baselines["python -c pass"])
    header = ("", "start→first", "start→all", "RSS", "anon", "peak RSS", "PSS")
    width = max(28, *(len(name) for name in [*baselines, *results]))
    names = "{:<" + str(width) + "}"  # the first column, as wide as the longest row name
    print((names + " {:>12} {:>10} {:>10} {:>10} {:>10} {:>10}").format(*header))
    row = names + " {:>9.0f} ms {:>10} {:>6.1f} MiB {:>6.1f} MiB {:>10} {:>10}"
    for name, samples in baselines.items():
        ms = statistics.median(sample.ms for sample in samples)
        mib = statistics.median(sample.rss_mib for sample in samples)
        anon = statistics.median(total(sample.mappings).anon_mib for sample in samples)
        print(row.format(name, ms, "", mib, anon, "", ""))
    minimal_mib = statistics.median(
        sample.rss_mib for sample in baselines["minimal gRPC+X.509 program"]
    )
    row = (
        names + " {:>9.0f} ms {:>7.0f} ms {:>6.1f} MiB {:>6.1f} MiB {:>6.1f} MiB {:>6.1f} MiB"
        "   ÷ bare python: "
    )
    for name, runs in results.items():
        first = median_of(runs, lambda r: r.first_secret_ms)
        every = median_of(runs, lambda r: r.all_secrets_ms)
        rss = median_of(runs, lambda r: r.rss_mib)
        anon = median_of(runs, lambda r: r.anon_mib)
        peak = median_of(runs, lambda r: r.peak_rss_mib)
        pss = median_of(runs, lambda r: r.pss_mib)
        print(
            row.format(name, first, every, rss, anon, peak, pss)
            + f"{first / floor_ms:4.1f}x time, {rss / floor_mib:4.1f}x RSS; "
            + f"RSS ÷ minimal program {rss / minimal_mib:4.2f}x"
        )
    for name in ("sidecar (meshca agent)", "sidecar (-m agent.main)"):
        first = median_of(results[name], lambda r: r.first_secret_ms)
        rss = median_of(results[name], lambda r: r.rss_mib)
        print(
            f"{name} targets: start→first secret {first:.0f} ms (≤ 300: "
            f"{'met' if first <= 300 else 'NOT met'}), RSS {rss:.1f} MiB (≤ 50: "
            f"{'met' if rss <= 50 else 'NOT met'}; the minimal program: {minimal_mib:.1f} MiB)"
        )
    plain = results["sidecar (meshca agent)"]
    for name, value in args.agent_env:
        variant = results[f"sidecar, {name}={value}"]
        rss, anon, first = (
            median_of(variant, field) - median_of(plain, field)
            for field in (
                lambda r: r.rss_mib,
                lambda r: r.anon_mib,
                lambda r: r.first_secret_ms,
            )
        )
        print(
            f"{name}={value} vs the plain sidecar of this run: RSS {rss:+.2f} MiB, "
            f"anonymous {anon:+.2f} MiB, start→first secret {first:+.0f} ms"
        )
    print_breakdown(
        {
            "bare python": [sample.mappings for sample in baselines["python -c pass"]],
            "floor": [sample.mappings for sample in baselines["grpc+cryptography floor"]],
            "minimal": [sample.mappings for sample in baselines["minimal gRPC+X.509 program"]],
            "import agent": [sample.mappings for sample in baselines["import agent.main"]],
            "sidecar": [run.mappings for run in results["sidecar (meshca agent)"]],
        },
        difference=("sidecar", "minimal"),
    )
    return 0


def print_breakdown(
    columns: dict[str, list[dict[str, Resident]]], difference: tuple[str, str]
) -> None:
    """Where each process's RSS is, per group of mappings (`bench.proc_memory`), as
    anonymous/file-backed MiB (medians over the runs), and the difference of two columns: what
    can be cut is in the anonymous part; the file-backed part is library pages, shared between
    processes and reclaimable."""

    def median_resident(samples: list[Resident]) -> Resident:
        return Resident(
            statistics.median(each.anon_mib for each in samples),
            statistics.median(each.file_mib for each in samples),
        )

    cells: dict[str, dict[str, Resident]] = {
        column: {
            **{group: median_resident([run[group] for run in runs]) for group in GROUP_NAMES},
            "total": median_resident([total(run) for run in runs]),
        }
        for column, runs in columns.items()
    }
    minuend, subtrahend = difference
    cells[f"{minuend}-{subtrahend}"] = {
        group: Resident(
            cells[minuend][group].anon_mib - cells[subtrahend][group].anon_mib,
            cells[minuend][group].file_mib - cells[subtrahend][group].file_mib,
        )
        for group in (*GROUP_NAMES, "total")
    }
    print("\nWhere the RSS is: anonymous / file-backed MiB per group of mappings (/proc/PID/smaps)")
    print(f"{'':<42}" + "".join(f"{column:>17}" for column in cells))
    print(f"{'':<42}" + f"{'anon /  file':>17}" * len(cells))

    def tenths(mib: float) -> float:
        return round(mib, 1) or 0.0  # a difference of -0.04 reads 0.0, not -0.0

    for group in (*GROUP_NAMES, "total"):
        print(
            f"{group:<42}"
            + "".join(
                f"{tenths(cell[group].anon_mib):>9.1f} /{tenths(cell[group].file_mib):>6.1f}"
                for cell in cells.values()
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
