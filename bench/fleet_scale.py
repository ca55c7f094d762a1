"""The CA at fleet scale on a real kube-apiserver + etcd: start-up, memory and CPU with N pods,
pod cache on vs off, and new-token throughput (issue 30).

Run: `.venv/bin/python -m bench.fleet_scale --pods 0,20000,60000 [--workers 2,1] [--tokens 2000]`

One control plane (`tests.support.real_kube`, the binaries `make test` builds) for the whole
run. The fleet (`bench.fleet_cluster`: 200 namespaces, 500 nodes, 50 service accounts per
namespace, pods spread over them) grows from one N to the next; creation rates are printed.
For each N and each `--workers` count, two `meshca ca` in Kubernetes mode run one after the
other, each as its own ServiceAccount with deploy/'s RBAC (so the audit log tells their
requests apart), `--no-root-configmaps` (root publication is its own measurement):
- **cache on**: `CA_TRUSTED_NODE_ACCOUNTS` set and `--token-validation offline` (pod and
  ServiceAccount caches);
- **cache off**, the baseline: `--token-validation tokenreview`, no trusted node accounts, with
  `--kube-qps`/`--kube-burst` lifted so TokenReview throughput is the CA's, not its limiter's.

Per CA: ready time from spawn (`bench.ca_tree`: /ready 200, and the pod cache synced when the
CA exports that gauge), CPU to ready summed over the process tree, RSS summed over the tree
once settled, peak (sum of per-process VmHWM: an upper bound of the peak of the sum), worker
restarts, the API requests it made until ready (audit log, `bench.audit_tally`; a paginated
list's later pages counted apart), the CPU that 1,000 pod label changes cost it (idle CPU over
the same time subtracted), and CreateCertificate throughput with a new pod-bound token per
request vs the same tokens again, TokenReviews counted in the audit log, CPU ms per token.
A CA that exits before ready (today at ~60,000 pods: "could not list pods within 30s") is
reported "never ready" with its reason.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.audit_tally import AuditLog
from bench.ca_tree import CaTree, wait_ready
from bench.fleet_cluster import Fleet, FleetShape
from bench.fleet_report import CaRun, TokenRun, print_report, start_row, token_row
from bench.token_load import Call, CertificateLoad, CsrBook
from tests.support.ca_process import CaProcess
from tests.support.real_kube import RealControlPlane, apply_deploy_rbac

TRUSTED_NODE_ACCOUNT = "kube-system/ztunnel"
LIFTED_QPS = "100000"


@dataclass(frozen=True)
class Options:
    pods: list[int]
    workers: list[int]
    tokens: int
    events: int
    concurrency: int
    shape: FleetShape
    ready_timeout: float
    idle_seconds: float
    threads: int
    keep: bool


class Bench:
    """The control plane, the fleet and the CAs of one run."""

    def __init__(self, options: Options, directory: Path) -> None:
        self.options = options
        self.directory = directory
        self.plane = RealControlPlane().start()
        self.audit = AuditLog(self.plane.audit_path)
        self.fleet = Fleet(self.plane, options.shape, options.threads)
        self.csrs = CsrBook()
        self._cas = 0
        self._rounds = 0

    def close(self) -> None:
        self.plane.stop()

    # -- the CA ----------------------------------------------------------------------------

    def _account(self) -> tuple[str, Path]:
        """A namespace and ServiceAccount `meshca` of its own for the next CA, with deploy/'s
        RBAC: its own Secret and Lease, its own user in the audit log."""
        self._cas += 1
        namespace = f"bench-ca-{self._cas}"
        self.plane.create_namespace(namespace)
        self.plane.create_service_account(namespace, "meshca")
        apply_deploy_rbac(self.plane, namespace, "meshca")
        kubeconfig = self.plane.account_kubeconfig(
            self.directory / f"{namespace}.kubeconfig", namespace, "meshca"
        )
        return namespace, kubeconfig

    def _launch(self, workers: int, pod_cache: bool) -> tuple[CaProcess, str, CaTree, float]:
        namespace, kubeconfig = self._account()
        mode = (
            ["--token-validation", "offline"]
            if pod_cache
            else ["--token-validation", "tokenreview"]
        )
        ca = CaProcess(
            self.directory / namespace,
            "--kubeconfig",
            str(kubeconfig),
            "--namespace",
            namespace,
            "--instance-id",
            namespace,
            "--no-root-configmaps",
            "--workers",
            str(workers),
            "--kube-qps",
            LIFTED_QPS,
            "--kube-burst",
            LIFTED_QPS,
            *mode,
            env={"CA_TRUSTED_NODE_ACCOUNTS": TRUSTED_NODE_ACCOUNT} if pod_cache else None,
        )
        username = f"system:serviceaccount:{namespace}:meshca"
        wall = time.time()
        tree = CaTree(ca)
        ca.launch()
        return ca, username, tree, wall

    def measure(self, pods: int, workers: int, pod_cache: bool) -> CaRun:
        ca, username, tree, wall = self._launch(workers, pod_cache)
        try:
            ready = wait_ready(tree, self.options.ready_timeout, pod_cache)
            run = CaRun(pods, workers, pod_cache, ready)
            time.sleep(0.5)  # the audit log is written as requests complete
            run.start_calls = self.audit.tally(
                username, wall, wall + (ready.seconds or self.options.ready_timeout) + 0.5
            )
            if ready.seconds is not None:
                run.rss_mib = tree.settled_rss()
                idle = tree.cpu_rate(self.options.idle_seconds)
                if pods and self.options.events:
                    run.events, run.event_cpu = self._events(tree, idle)
            # The start's peak (and the events'): the token rounds below are a load of their own.
            run.peak_mib = tree.peak_mib
            if ready.seconds is not None and self.options.tokens and pods:
                run.tokens = self._token_rounds(ca, tree, username, pod_cache)
            tree.sample()
            run.restarts = tree.replaced_processes(workers)
            if not ca.running and ready.seconds is not None:
                run.died_after_ready = True
            return run
        finally:
            ca.stop(timeout=20)

    def _events(self, tree: CaTree, idle_rate: float) -> tuple[int, float]:
        """CPU the tree spends on `--events` pod changes, over its idle rate."""
        self._rounds += 1
        chosen = self.fleet.spread(self.options.events)
        before = tree.sample().cpu_seconds
        started = time.monotonic()
        self.fleet.label(chosen, str(self._rounds))
        tree.wait_quiet(idle_rate)
        seconds = time.monotonic() - started
        spent = tree.sample().cpu_seconds - before - idle_rate * seconds
        return len(chosen), max(0.0, spent)

    # -- tokens ----------------------------------------------------------------------------

    def calls(self) -> list[Call]:
        """A new pod-bound token for each of `--tokens` pods spread over the fleet."""
        chosen = self.fleet.spread(self.options.tokens)
        tokens = self.fleet.tokens(chosen)
        calls = []
        for index, token in zip(chosen, tokens, strict=True):
            namespace, _, account, _ = self.fleet.shape.pod(index)
            calls.append(Call(token, self.csrs.csr(namespace, account)))
        return calls

    def _token_rounds(self, ca: CaProcess, tree: CaTree, username: str, offline: bool) -> TokenRun:
        calls = self.calls()
        root = ca.root_cert_path.read_bytes()
        rounds = []
        with CertificateLoad(ca.addr, root, self.options.concurrency) as load:
            for _ in ("new", "cached"):
                cpu = tree.sample().cpu_seconds
                wall = time.time()
                result = load.send(calls)
                cpu = tree.sample().cpu_seconds - cpu
                time.sleep(0.3)
                reviews = self.audit.tally(username, wall, time.time())["create tokenreviews"]
                rounds.append((result, reviews, cpu))
        (new, reviews_new, cpu_new), (cached, reviews_cached, cpu_cached) = rounds
        mode = "offline" if offline else "tokenreview"
        return TokenRun(mode, new, cached, reviews_new, reviews_cached, cpu_new, cpu_cached)


# -- main ----------------------------------------------------------------------------------


def run(options: Options) -> list[CaRun]:
    directory = Path(tempfile.mkdtemp(prefix="fleet-", dir="/tmp"))
    bench = Bench(options, directory)
    runs: list[CaRun] = []
    try:
        for created in bench.fleet.scaffold():
            print(f"created {created.describe()}", flush=True)
        for pods in options.pods:
            print(f"created {bench.fleet.grow_to(pods).describe()} (fleet: {pods:,})", flush=True)
            for workers in options.workers:
                for pod_cache in (True, False):
                    result = bench.measure(pods, workers, pod_cache)
                    print(start_row(result), flush=True)
                    if result.tokens is not None:
                        print(token_row(result), flush=True)
                    runs.append(result)
    finally:
        bench.close()
        if options.keep:
            print(f"CA logs and kubeconfigs kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return runs


def _counts(text: str) -> list[int]:
    return [int(part.replace("_", "")) for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=_counts, default=[0, 20000, 60000], help="N,N,... ascending")
    parser.add_argument("--workers", type=_counts, default=[2], help="`--workers` values, e.g. 2,1")
    parser.add_argument(
        "--tokens", type=int, default=2000, help="distinct pod-bound tokens (0: skip)"
    )
    parser.add_argument("--events", type=int, default=1000, help="pods changed for the event cost")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--namespaces", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--accounts-per-namespace", type=int, default=50)
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--idle-seconds", type=float, default=3.0, help="idle CPU baseline window")
    parser.add_argument("--threads", type=int, default=16, help="creation threads")
    parser.add_argument("--keep", action="store_true", help="keep CA logs")
    args = parser.parse_args(argv)
    if args.pods != sorted(args.pods):
        parser.error("--pods must be ascending: the fleet grows, it is never shrunk")
    shape = FleetShape(args.namespaces, args.nodes, args.accounts_per_namespace)
    return Options(
        args.pods,
        args.workers,
        args.tokens,
        args.events,
        args.concurrency,
        shape,
        args.ready_timeout,
        args.idle_seconds,
        args.threads,
        args.keep,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    print(
        f"fleet: {options.shape.namespaces} namespaces, {options.shape.nodes} nodes, "
        f"{options.shape.accounts_per_namespace} service accounts per namespace; "
        f"pods {', '.join(f'{n:,}' for n in options.pods)}; workers {options.workers}",
        flush=True,
    )
    print_report(run(options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
