"""A running `meshca ca` as a process tree (supervisor + workers, or one process), sampled from
/proc for the benchmarks: CPU, resident memory summed over the tree, each process's peak, and
which processes came and went (a worker that died and was replaced).

Peak: the kernel keeps each process's own high-water mark (VmHWM); the tree's true peak is the
peak of the *sum*, which no counter records. The sum of the per-process peaks is an upper bound
of it (the processes need not have peaked at the same moment), and what `peak_mib` reports.
Processes that exited keep the last peak sampled, so sample often while it starts.

Readiness, one rule for the CA of today and the one that syncs its cache after serving: `/ready`
is 200, and when the CA exports `meshca_ca_kube_cache_synced{resource="pods"}` that gauge is 1
on every series (a cache that is still listing is not ready for what the bench measures).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from bench.proc_cpu import own_cpu_seconds, process_tree
from bench.proc_memory import status_mib
from tests.support.ca_process import CaProcess
from tests.support.processes import http_status, http_text

SYNCED_METRIC = "meshca_ca_kube_cache_synced"
OBJECTS_METRIC = "meshca_ca_kube_cache_objects"


def pod_cache_gauge(exposition: str, name: str) -> list[float] | None:
    """Every sample of `name{resource="pods"}` (one per worker in multiprocess mode), or None
    when the CA does not export it."""
    values = [
        float(sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and sample.labels.get("resource") == "pods"
    ]
    return values or None


@dataclass
class TreeSample:
    cpu_seconds: float
    rss_mib: float


@dataclass
class CaTree:
    """Samples of `ca`'s process tree since it was spawned."""

    ca: CaProcess
    spawned: float = field(default_factory=time.monotonic)
    peak_by_pid: dict[int, float] = field(default_factory=dict)
    cpu_by_pid: dict[int, float] = field(default_factory=dict)
    pids_seen: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        assert self.ca.proc is not None, "launch the CA first"
        return self.ca.proc.pid

    def sample(self) -> TreeSample:
        """RSS of the living tree now, and CPU of every process seen since the spawn (a worker
        that died counts with its last sample: the supervisor reaping it would otherwise take
        its CPU out of the tree); records each process's peak on the way."""
        rss = 0.0
        for pid in process_tree(self.pid):
            cpu = own_cpu_seconds(pid)
            try:
                vm_rss, _, vm_hwm = status_mib(pid)
            except (OSError, KeyError, IndexError):
                continue  # gone meanwhile, or a zombie without memory fields
            self.pids_seen.add(pid)
            rss += vm_rss
            self.peak_by_pid[pid] = max(vm_hwm, self.peak_by_pid.get(pid, 0.0))
            if cpu is not None:
                self.cpu_by_pid[pid] = max(cpu, self.cpu_by_pid.get(pid, 0.0))
        return TreeSample(sum(self.cpu_by_pid.values()), rss)

    @property
    def peak_mib(self) -> float:
        """Sum of per-process VmHWM: an upper bound of the tree's true peak."""
        return sum(self.peak_by_pid.values())

    def replaced_processes(self, workers: int) -> int:
        """Processes seen beyond the tree's size: workers restarted by the supervisor."""
        expected = workers + 1 if workers > 1 else 1
        return max(0, len(self.pids_seen) - expected)

    def settled_rss(
        self, window: int = 4, tolerance_mib: float = 2.0, limit: float = 20.0
    ) -> float:
        """RSS once `window` samples 0.5 s apart agree within `tolerance_mib` (at most `limit`
        seconds): what the CA keeps after the start's transient allocations are freed."""
        samples: list[float] = []
        deadline = time.monotonic() + limit
        while True:
            samples.append(self.sample().rss_mib)
            recent = samples[-window:]
            if len(recent) == window and max(recent) - min(recent) <= tolerance_mib:
                return recent[-1]
            if time.monotonic() > deadline:
                return samples[-1]
            time.sleep(0.5)

    def cpu_rate(self, seconds: float) -> float:
        """CPU seconds per second the tree uses over `seconds` from now."""
        before = self.sample().cpu_seconds
        started = time.monotonic()
        time.sleep(seconds)
        return (self.sample().cpu_seconds - before) / (time.monotonic() - started)

    def wait_quiet(self, idle_rate: float, margin: float = 0.03, limit: float = 120.0) -> None:
        """Returns once two 0.5 s windows in a row used no more CPU than `idle_rate` plus
        `margin` CPU-seconds per second (at most `limit` seconds)."""
        deadline = time.monotonic() + limit
        quiet = 0
        while quiet < 2 and time.monotonic() < deadline:
            quiet = quiet + 1 if self.cpu_rate(0.5) <= idle_rate + margin else 0


@dataclass(frozen=True)
class Readiness:
    seconds: float | None  # None: never ready
    cpu_seconds: float
    why_not: str = ""
    pods_in_cache: float | None = None  # meshca_ca_kube_cache_objects, when exported


def _startup_failure(log: str) -> str:
    lines = [line for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if "cannot start" in line or "could not" in line:
            return line.strip()[-240:]
    return lines[-1].strip()[-240:] if lines else "(empty log)"


def wait_ready(tree: CaTree, timeout: float, pod_cache: bool) -> Readiness:
    """Polls until the CA is ready (see the module docstring), exits, or `timeout` passes.
    `/ready` every 0.1 s; `/metrics` (a sum over the workers' files, not free for the CA) at
    most every 0.5 s, and only once `/ready` is 200."""
    ca = tree.ca
    deadline = tree.spawned + timeout
    next_scrape = 0.0
    while time.monotonic() < deadline:
        sample = tree.sample()
        if not ca.running:
            code = ca.proc.returncode if ca.proc else None
            return Readiness(
                None,
                sample.cpu_seconds,
                f"exited ({code}) after {time.monotonic() - tree.spawned:.0f} s: "
                f"{_startup_failure(ca.log())}",
            )
        if http_status(f"{ca.monitoring_url}/ready") == 200:
            if not pod_cache:
                return Readiness(time.monotonic() - tree.spawned, sample.cpu_seconds)
            if time.monotonic() >= next_scrape:
                next_scrape = time.monotonic() + 0.5
                try:
                    exposition = http_text(f"{ca.monitoring_url}/metrics")
                except OSError:
                    exposition = ""
                synced = pod_cache_gauge(exposition, SYNCED_METRIC)
                counted = pod_cache_gauge(exposition, OBJECTS_METRIC)
                if exposition and (synced is None or min(synced) >= 1):
                    seconds = time.monotonic() - tree.spawned
                    objects = max(counted) if counted else None
                    return Readiness(seconds, sample.cpu_seconds, "", objects)
        time.sleep(0.1)
    return Readiness(None, tree.sample().cpu_seconds, f"not ready within {timeout:.0f} s")
