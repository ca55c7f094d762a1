"""`meshca up`: a local CA plus one agent, for trying meshca on a laptop.

Starts `python -m meshca ca --data-dir DIR/ca` as a child process, mints a development token
for `default/default` with `python -m meshca token` (re-minted at half its lifetime, as the
kubelet refreshes projected tokens), and runs an agent in this process writing to `DIR/certs`
and serving SDS on `DIR/sds.sock`. `--secret-ttl 30s` makes rotation visible within a minute.

Concurrency: one asyncio loop runs the agent and the token refresher; the CA is a child
process reaped on exit. Ctrl-C (SIGINT) or SIGTERM stops the agent, then the CA.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from agent.config import AgentConfig, ConfigError
from agent.main import Agent, AgentFailed
from meshca.clock import SystemClock
from meshca.durations import parse_duration
from meshca.files import atomic_write, ensure_dir
from meshca.host_port import join_host_port
from meshca.listen import ListenError, check_can_listen, parse_listen
from meshca.logs import configure_logging
from meshca.waiting import cancel_and_wait

log = logging.getLogger(__name__)

TOKEN_TTL_SECONDS = 3600
NAMESPACE = "default"
SERVICE_ACCOUNT = "default"


@dataclass(frozen=True)
class UpConfig:
    """Where `meshca up` keeps its state, how long certificates live, where status is served."""

    directory: Path
    secret_ttl: timedelta
    secret_ttl_text: str  # as the operator wrote it, for the banner
    status_host: str
    status_port: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> UpConfig:
        """Flags only: the environment is accepted for the common shape and not consulted."""
        del environ
        try:
            ttl = parse_duration(args.secret_ttl)
        except ValueError as exc:
            raise UpConfigError(f"--secret-ttl: {exc}") from None
        if ttl <= timedelta(0):
            raise UpConfigError(f"--secret-ttl {args.secret_ttl}: must be positive, e.g. 30s")
        try:
            host, port = parse_listen("--status-listen", args.status_listen)
        except ValueError as exc:
            raise UpConfigError(str(exc)) from None
        directory = Path(args.dir).resolve()
        if directory.exists() and not directory.is_dir():
            raise UpConfigError(f"--dir {args.dir}: is not a directory; give a directory")
        return cls(
            directory=directory,
            secret_ttl=ttl,
            secret_ttl_text=args.secret_ttl,
            status_host=host,
            status_port=port,
        )


class UpConfigError(ValueError):
    """A `meshca up` flag the command cannot use; the message names it."""


class UpFailed(Exception):
    """The local CA did not come up; the message says where its log is."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="./.meshca", help="working directory [./.meshca]")
    parser.add_argument("--secret-ttl", default="24h", help="workload certificate lifetime [24h]")
    parser.add_argument("--status-listen", default="127.0.0.1:15020", help="agent status address")


def run(args: argparse.Namespace) -> int:
    """Entry point for `meshca up`."""
    configure_logging("INFO")
    try:
        config = UpConfig.from_args(args, {})
    except UpConfigError as exc:
        log.error("%s", exc)
        return 2
    try:
        status_listen = join_host_port(config.status_host, config.status_port)
        check_can_listen("--status-listen", status_listen)
        asyncio.run(_up(config))
    except (ListenError, UpFailed, ConfigError, AgentFailed) as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error("meshca up: cannot use --dir %s: %s", config.directory, exc.strerror or exc)
        return 1
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _meshca(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshca", *args]


class LocalCa:
    """The CA child process and the way to mint tokens it trusts."""

    def __init__(self, data_dir: Path, min_ttl: str) -> None:
        self.data_dir = data_dir
        self.port = _free_port()
        self.monitoring_port = _free_port()
        self.min_ttl = min_ttl
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        ensure_dir(self.data_dir, 0o700)
        log_file = open(self.data_dir.parent / "ca.log", "ab")  # noqa: SIM115 - child owns it
        self.proc = subprocess.Popen(
            _meshca(
                "ca",
                "--data-dir",
                str(self.data_dir),
                "--listen",
                self.addr,
                "--monitoring-listen",
                f"127.0.0.1:{self.monitoring_port}",
                "--min-workload-cert-ttl",
                self.min_ttl,
                # One agent needs no worker processes: a single CA process starts and stops in
                # a fraction of the time a supervisor and a worker per CPU take.
                "--workers",
                "1",
            ),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        log_file.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UpFailed(f"the CA exited early; see {self.data_dir.parent / 'ca.log'}")
            try:
                url = f"http://127.0.0.1:{self.monitoring_port}/ready"
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise UpFailed(
            f"the CA did not become ready in {timeout:.0f}s; see {self.data_dir.parent / 'ca.log'}"
        )

    def mint_token(self) -> str:
        out = subprocess.run(
            _meshca(
                "token",
                "--data-dir",
                str(self.data_dir),
                "--namespace",
                NAMESPACE,
                "--service-account",
                SERVICE_ACCOUNT,
                "--ttl",
                f"{TOKEN_TTL_SECONDS}s",
            ),
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _refresh_token(ca: LocalCa, path: Path) -> None:
    """Keeps a valid token in `path`, renewing at half its lifetime."""
    while True:
        await asyncio.sleep(TOKEN_TTL_SECONDS / 2)
        try:
            token = await asyncio.to_thread(ca.mint_token)
            atomic_write(path, token, 0o600)
        except (subprocess.SubprocessError, OSError) as exc:
            log.warning("could not refresh the development token: %s; retrying in 60s", exc)
            await asyncio.sleep(60)


async def _up(up: UpConfig) -> None:
    directory = up.directory
    ensure_dir(directory, 0o700)
    # Signals are handled from the start: a Ctrl-C while the CA is still starting must stop
    # (and reap) the CA child too, not leave it running behind a KeyboardInterrupt.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ca = LocalCa(directory / "ca", min_ttl="1s")
    starting = asyncio.ensure_future(asyncio.to_thread(ca.start))
    agent: Agent | None = None
    refresher: asyncio.Task[None] | None = None
    try:
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if stop.is_set():
            return
        starting.result()  # raises if the CA could not start
        token_path = directory / "token"
        atomic_write(token_path, await asyncio.to_thread(ca.mint_token), 0o600)
        config = AgentConfig(
            ca_addr=ca.addr,
            ca_root_ca=ca.data_dir / "root-cert.pem",
            namespace=NAMESPACE,
            service_account=SERVICE_ACCOUNT,
            secret_ttl=up.secret_ttl,
            token_path=token_path,
            output_certs=directory / "certs",
            sds_socket=directory / "sds.sock",
            status_host=up.status_host,
            status_port=up.status_port,
        )
        agent = Agent(config, clock=SystemClock())
        refresher = asyncio.create_task(_refresh_token(ca, token_path))
        await agent.start()
        print(
            f"meshca is up: CA at {ca.addr} (log {directory / 'ca.log'})\n"
            f"  identity:  spiffe://cluster.local/ns/{NAMESPACE}/sa/{SERVICE_ACCOUNT}\n"
            f"  SDS:       unix:{config.sds_socket}\n"
            f"  files:     {config.output_certs}/{{cert-chain,key,root-cert}}.pem\n"
            f"  ready:     {agent.status.url}/healthz/ready\n"
            f"  metrics:   {agent.status.url}/metrics\n"
            f"  rotating every ~half of {up.secret_ttl_text}; Ctrl-C to stop",
            flush=True,
        )
        await stop.wait()
    finally:
        await cancel_and_wait(refresher)
        if agent is not None:
            await agent.stop()
        await asyncio.to_thread(ca.stop)  # also ends a start still waiting for the CA
        with contextlib.suppress(Exception):
            await starting
        await asyncio.to_thread(ca.stop)  # in case it started after the first stop
        log.info("meshca up: stopped")
