"""`meshca ca --workers N`: N CA processes on one port, supervised by one parent.

Why processes: one Python process signs on one core at a time (the GIL), and the CA is
CPU-bound (parse + verify a CSR, build + sign a leaf). N workers serve the same gRPC ports with
`SO_REUSEPORT`, so the kernel spreads connections across them and every core signs.

What each side does:
- A worker is an ordinary `meshca ca` process (`ca_server.server`) started with the parent's own
  flags plus `--workers 1 --worker-slot K --worker-ready-file F`. Workers share the root the way
  replicas already do: the data directory under its file lock, or the Kubernetes Secret (each
  worker is then a replica with its own instance id). Each writes its metrics into
  prometheus-client's multiprocess directory (`PROMETHEUS_MULTIPROC_DIR`, one per run).
- The supervisor (this module) owns the monitoring port: `/metrics` summed over the workers
  (`ca_server.metrics.aggregated_registry`), `/healthz`, `/ready` (200 once every worker has
  created its ready file and is alive), and on `--debug-listen` `/debug/ca` merged from the
  parts the live workers publish in the run directory (`ca_server.serving.worker_status`, about 1 s
  fresh). It restarts a worker that dies, after a backoff that grows while workers keep
  dying, and on SIGTERM/SIGINT stops them all (SIGTERM, then SIGKILL after the shutdown grace
  plus a margin). A worker that fails before any worker was ever ready is a configuration
  problem, not a crash: the supervisor stops and exits with its status.
- In Kubernetes mode the supervisor holds the replica's one set of cluster-wide caches (pods,
  ServiceAccounts: `ca_server.kube.supervisor_caches`) and answers the workers' lookups on a
  Unix socket in its run directory, so a replica lists and watches them once whatever N, and
  holds them once. Their progress is on `/ready`, their gauges on `/metrics`.
- Port 0 means "pick one": the supervisor reserves a concrete port with a bound, non-listening
  `SO_REUSEPORT` socket and hands it to every worker, so they all share the same one.

Concurrency: the supervisor is single-threaded (a 100 ms poll loop in the main thread); the
monitoring HTTP server runs in its own thread and only reads the worker table.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import multiprocess
from prometheus_client.registry import Collector

from ca_server.config import CaConfig, WorkerRole
from ca_server.metrics import aggregated_registry
from ca_server.serving.worker_status import merged_document
from meshca.host_port import join_host_port
from meshca.listen import ListenError, parse_listen
from meshca.status_http import (
    Response,
    StatusServer,
    json_response,
    metrics_route,
    text,
)

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Restart backoff: doubles for each death within `_STABLE_AFTER` of a start, up to the cap.
_FIRST_RESTART_DELAY = 0.5
_MAX_RESTART_DELAY = 30.0
_STABLE_AFTER = 60.0
_POLL_INTERVAL = 0.1
# Beyond the workers' own shutdown grace, how long they may take to exit before SIGKILL.
_STOP_MARGIN = 3.0
_PR_SET_PDEATHSIG = 1


def default_worker_count(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: the CPUs it may run on (`sched_getaffinity` honours
    taskset and cpusets, unlike `cpu_count`), bounded by a CPU quota (a container's CPU limit,
    which leaves the affinity at every CPU of the node), rounded down and at least 1: workers
    beyond the quota would only be throttled, which shows up as latency spikes."""
    cpus = len(os.sched_getaffinity(0))
    quota = cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, int(quota))
    return max(1, cpus)


def cpu_quota(cgroup_root: Path) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 `cpu.max`, or v1
    `cpu.cfs_quota_us`/`cpu.cfs_period_us`); `None` when unlimited or unreadable."""
    try:
        quota, _, period = (cgroup_root / "cpu.max").read_text().partition(" ")
        if quota.strip() == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for directory in ("cpu", "cpu,cpuacct"):
        try:
            quota_us = int((cgroup_root / directory / "cpu.cfs_quota_us").read_text())
            period_us = int((cgroup_root / directory / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this worker when its supervisor dies (even by SIGKILL), so a
    killed supervisor never leaves workers holding the port."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's SIGTERM still stops us
        return
    if os.getppid() == 1:  # the supervisor died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class PortReservation:
    """Turns `host:0` into a concrete port every worker can bind with SO_REUSEPORT.

    The reserving socket is bound but never listens, so it takes no connections."""

    def __init__(self) -> None:
        self._sockets: list[socket.socket] = []

    def resolve(self, flag: str, listen: str) -> str:
        """`listen` with a concrete port; a port another process holds, or an address that is
        not this host's, is a `ListenError` naming `flag` (before any worker starts)."""
        try:
            host, port = parse_listen(flag, listen)
        except ValueError as exc:
            raise ListenError(str(exc)) from None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise ListenError(
                f"{flag} {listen}: cannot listen there: {exc.strerror or exc} (stop what holds "
                "the port or pick another one)"
            ) from None
        self._sockets.append(sock)
        if port != 0:
            return listen
        chosen = sock.getsockname()[1]
        return join_host_port(host, chosen)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


@dataclass
class _Slot:
    index: int
    ready_file: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    restart_delay: float = _FIRST_RESTART_DELAY
    restarts: int = 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        return self.alive() and self.ready_file.exists()

    def not_ready_reason(self) -> str | None:
        """The `not ready: ...` line a serving worker wrote in its ready file (its signing
        chain expired or not valid yet: `ca_server.serving.readiness`), if any."""
        try:
            lines = self.ready_file.read_text().splitlines()
        except OSError:
            return None
        return next((line for line in lines if line.startswith("not ready: ")), None)

    @property
    def status_file(self) -> Path:
        return WorkerRole(self.index, self.ready_file).status_file


WorkerCommand = Callable[[int, Path, Sequence[str]], list[str]]


class SharedCaches(Protocol):
    """What the supervisor holds for all its workers (`ca_server.kube.supervisor_caches`)."""

    @property
    def collector(self) -> Collector: ...

    def start(self, socket_path: Path) -> None: ...

    @property
    def synced(self) -> bool: ...

    def readiness_lines(self) -> str: ...

    def stop(self) -> None: ...


class WorkerSupervisor:
    """Runs `count` workers until SIGTERM/SIGINT; returns the exit status for `meshca ca`.

    `worker_command(slot, ready_file, overrides)` gives a worker's argv; `overrides` are extra
    flags (the resolved listen addresses) that must come last.
    """

    def __init__(
        self,
        config: CaConfig,
        count: int,
        worker_command: WorkerCommand,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        shared: SharedCaches | None = None,
    ) -> None:
        self._shared = shared
        self._config = config
        self._count = count
        self._worker_command = worker_command
        self._monotonic = monotonic
        self._now = now
        self._started = now()
        self._stop = threading.Event()
        self._run_dir = Path(tempfile.mkdtemp(prefix="meshca-ca-"))
        self._metrics_dir = self._run_dir / "metrics"
        self._metrics_dir.mkdir()
        self._slots = [_Slot(i, self._run_dir / f"ready-{i}") for i in range(count)]
        self._ever_ready = False
        self._ports = PortReservation()
        # The JWT-SVID keys, when this supervisor serves discovery (else not known here).
        self._jwt_status: Callable[[], dict[str, Any] | None] = lambda: None

    def ready(self) -> bool:
        return all(slot.ready() for slot in self._slots)

    def readiness(self) -> Response:
        """`/ready`: 200 once every worker serves with a valid signing chain and the shared
        caches have synced; else 503, why. Below, the caches' progress."""
        detail = self._shared.readiness_lines() if self._shared is not None else ""
        if not self.ready():
            return text(503, f"starting\n{detail}")
        for slot in self._slots:
            reason = slot.not_ready_reason()
            if reason is not None:
                return text(503, f"{reason}\n{detail}")
        if self._shared is not None and not self._shared.synced:
            return text(503, f"syncing\n{detail}")
        return text(200, f"ready\n{detail}")

    def debug_ca(self) -> Response:
        """The single CA's `/debug/ca` document over the live workers' published parts."""
        parts = [slot.status_file for slot in self._slots if slot.alive()]
        document = merged_document(parts, self._started, self._now())
        if document is None:
            return text(503, "no CA worker has published its status yet\n")
        document["jwt_svid"] = self._jwt_status()  # the keys as the discovery server reads them
        return json_response(document)

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> int:
        servers: list[StatusServer] = []
        try:
            overrides = self._resolved_listen_flags()
            registry = aggregated_registry(self._metrics_dir)
            if self._shared is not None:
                registry.register(self._shared.collector)
                self._shared.start(WorkerRole(0, self._slots[0].ready_file).cache_socket)
            metrics = metrics_route(registry)
            servers.append(
                StatusServer(
                    self._config.monitoring_listen,
                    {
                        "/metrics": metrics,
                        "/healthz": lambda: text(200, "ok\n"),
                        "/ready": self.readiness,
                    },
                )
            )
            if self._config.jwt.oidc_listen:
                # One discovery port for the group, from the keys the workers share (imported
                # here: a supervisor without discovery loads none of it).
                from ca_server.jwt_svid import discovery_server, status_section, stored_jwks_for
                from meshca.clock import SystemClock

                jwks = stored_jwks_for(self._config, SystemClock())
                oidc = discovery_server(
                    self._config.jwt.oidc_listen, jwks, self._config.jwt.jwks_max_age
                )
                servers.append(oidc)
                self._jwt_status = lambda: status_section(
                    jwks.state,
                    jwks.issuer,
                    oidc.url,
                    self._config.jwt.jwks_max_age,
                    jwks.coverage(),
                )
            if self._config.debug_listen is not None:
                servers.append(
                    StatusServer(
                        self._config.debug_listen,
                        {"/metrics": metrics, "/debug/ca": self.debug_ca},
                        name="debug",
                        flag="--debug-listen",
                    )
                )
        except BaseException:
            for server in servers:
                server.stop()
            if self._shared is not None:
                self._shared.stop()
            self._cleanup()
            raise
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.request_stop)
        for server in servers:
            server.start()
        log.info(
            "supervising %d CA workers on %s; monitoring on %s%s",
            self._count,
            " and ".join(o for o in overrides if not o.startswith("--")),
            self._config.monitoring_listen,
            f"; debug (/debug/ca) on {self._config.debug_listen}"
            if self._config.debug_listen
            else "",
        )
        try:
            for slot in self._slots:
                self._start(slot, overrides)
            return self._supervise(overrides)
        finally:
            self._stop_all()
            for server in servers:
                server.stop()
            if self._shared is not None:
                self._shared.stop()
            self._cleanup()

    def _resolved_listen_flags(self) -> list[str]:
        flags = ["--listen", self._ports.resolve("--listen", self._config.listen)]
        if self._config.jwt.oidc_listen:  # served here; the workers sign with its issuer
            flags += ["--oidc-listen", "", "--oidc-issuer", self._config.jwt.issuer or ""]
        if self._config.mtls_listen:
            mtls = self._ports.resolve("--mtls-listen", self._config.mtls_listen)
            flags += ["--mtls-listen", mtls]
        return flags

    def _start(self, slot: _Slot, overrides: Sequence[str]) -> None:
        slot.ready_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env[MULTIPROC_ENV] = str(self._metrics_dir)
        # Workers inherit stdout (audit lines) and stderr (logs); each audit line is one write.
        slot.proc = subprocess.Popen(
            self._worker_command(slot.index, slot.ready_file, overrides), env=env
        )
        slot.started_at = self._monotonic()
        slot.restart_at = None
        log.info("started CA worker %d (pid %d)", slot.index, slot.proc.pid)

    def _supervise(self, overrides: Sequence[str]) -> int:
        while not self._stop.wait(_POLL_INTERVAL):
            self._ever_ready = self._ever_ready or any(s.ready() for s in self._slots)
            now = self._monotonic()
            for slot in self._slots:
                if slot.proc is not None and slot.restart_at is None and not slot.alive():
                    status = self._reap(slot)
                    if not self._ever_ready:
                        log.error(
                            "CA worker %d exited with status %d before serving; stopping",
                            slot.index,
                            status,
                        )
                        return status or 1
                    self._schedule_restart(slot, status, now)
                if slot.restart_at is not None and now >= slot.restart_at:
                    slot.restarts += 1
                    self._start(slot, overrides)
        return 0

    def _reap(self, slot: _Slot) -> int:
        assert slot.proc is not None
        status = slot.proc.wait()
        multiprocess.mark_process_dead(slot.proc.pid, str(self._metrics_dir))
        slot.ready_file.unlink(missing_ok=True)
        slot.status_file.unlink(missing_ok=True)  # a killed worker could not remove it
        return status

    def _schedule_restart(self, slot: _Slot, status: int, now: float) -> None:
        if now - slot.started_at >= _STABLE_AFTER:
            slot.restart_delay = _FIRST_RESTART_DELAY
        delay = slot.restart_delay
        slot.restart_delay = min(_MAX_RESTART_DELAY, slot.restart_delay * 2)
        slot.restart_at = now + delay
        pid = slot.proc.pid if slot.proc else 0
        log.error(
            "CA worker %d (pid %d) exited with status %d; restarting it in %.1fs",
            slot.index,
            pid,
            status,
            delay,
        )

    def _stop_all(self) -> None:
        running = [slot.proc for slot in self._slots if slot.proc is not None and slot.alive()]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = self._monotonic() + self._config.shutdown_grace.total_seconds() + _STOP_MARGIN
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - self._monotonic()))
            except subprocess.TimeoutExpired:
                log.error("CA worker pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()

    def _cleanup(self) -> None:
        self._ports.close()
        shutil.rmtree(self._run_dir, ignore_errors=True)


def worker_argv(argv: Sequence[str]) -> WorkerCommand:
    """Workers run `python -m meshca` with the supervisor's own arguments, then the overrides
    (argparse keeps the last value of a repeated flag)."""

    def command(slot: int, ready_file: Path, overrides: Sequence[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "meshca",
            *argv,
            *overrides,
            "--workers",
            "1",
            "--worker-slot",
            str(slot),
            "--worker-ready-file",
            str(ready_file),
        ]

    return command
