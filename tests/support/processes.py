"""Starting and stopping real meshca processes from tests.

Every process is a child (`subprocess.Popen`) that the test waits for: PID 1 on these machines
does not reap orphans. The source tree is put on PYTHONPATH so a process started here runs the
code under test whether or not the project is installed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "proto")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# Ports for servers that tests start in child processes: below Linux's ephemeral range
# (32768-60999), which the kernel hands to every outgoing connection. A port asked of the kernel
# with bind(port 0) comes from that range, and between the test closing it and the child binding
# it, any client connection could take it ("Failed to bind" in CI).
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()


def _worker_port_range() -> tuple[int, int]:
    """This test process's share of `_PORT_RANGE`: pytest-xdist workers (`gw0`, `gw1`, ...)
    each pick from their own slice, so a port one worker found free cannot be taken by a
    server another worker starts before this one's child binds it (a CA that could not
    listen, in a CI run with the machine loaded). Outside xdist, the whole range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count < 2:
        return _PORT_RANGE
    low, high = _PORT_RANGE
    size = (high - low) // count
    start = low + int(worker[2:]) % count * size
    return start, start + size


@contextlib.contextmanager
def children_get_ctrl_c() -> Iterator[None]:
    """Children started inside stop on Ctrl-C (SIGINT) as a terminal's foreground job does.

    A test run started in the background of a non-interactive shell (`make test &`, some CI
    runners) has SIGINT *ignored*; an ignored signal stays ignored across exec, and Python then
    never raises KeyboardInterrupt. Handled signals are reset to their default on exec, so while
    children are started SIGINT is handled here (Python's own handler) instead of ignored. Not
    a `preexec_fn`: code run between fork and exec in a process that uses gRPC breaks gRPC's
    fork handlers in the child. Main thread only, as `signal.signal` requires."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the ephemeral range, never handed out
    before by this test process (so two servers of one test cannot be given the same one), and
    in this xdist worker's own slice (`_worker_port_range`)."""
    ports = _worker_port_range()
    for _ in range(1000):
        port = random.randrange(*ports)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {ports}")


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def stop_child(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 10) -> int:
    """Signals `proc` and reaps it; SIGKILL if it ignores `sig` for `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


class MeshcaProcess:
    """One `python -m meshca <args>` child with its output captured to a log file."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.args = list(args)
        self.log_path = log_path
        self.env = child_env(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it until exit
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshca", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.log_path.parent,
        )
        log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int | None:
        """Signals the child and reaps it; SIGKILL if it ignores `sig` for `timeout` seconds."""
        return None if self.proc is None else stop_child(self.proc, sig, timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
