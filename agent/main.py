"""`meshca agent`: composes the agent's parts and runs them until SIGTERM/SIGINT.

    CertificateSource (chosen once, `agent.certificate_source.certificate_source_for`):
      CA-backed:   identity source --set_identities--> CertificateScheduler --sign--> CaClient
                   (pod: one identity as `default`; node: the node's identities by SPIFFE ID)
      file-mounted: ./etc/certs/*.pem or the kubelet's credential bundle -> FileMountedSource
                                 | publish (ROOTCA first, then the leaf)
                                 v
        FileOutput (OUTPUT_CERTS) <- listener -- SecretCache --> SdsServer (Unix socket) -> Envoy
        AgentMetrics (expiry)     <- listener --'        file-cert:/file-root: names -'
        WorkloadApiServer (--workload-api-socket) <- SecretCache: the same default/ROOTCA
                         (node mode: each caller's SPIFFE ID, via PeerRelay + NodeAttestor)
        StatusServer (/healthz/ready, /metrics) reads the source's readiness + AgentMetrics

With OUTPUT_CERTS, the FileOutput (pod layout `OUTPUT/`, node layout `OUTPUT/<ns>/<sa>/`) is
also the scheduler's per-identity start hook: it restores the certificate a previous run left
there before the first CA call, so a restart while the CA is down keeps serving.

Every choice between implementations is made once, at construction: the certificate source
(and inside it the identity source), the file output's layout. `Agent` holds one of each and
never asks which kind it has.

Concurrency: one asyncio event loop runs the certificate source's worker (the scheduler's fetch
workers and timers), the CA client and the SDS server; watchdog's observer thread hands file
events to that loop; the status server runs on its own thread (see `agent.status`).
`Agent.stop()` stops everything, each step bounded, and the servers remove the sockets they
bound (`agent.unix_socket`), so the process exits within 5 s of a signal. The clock is chosen
here too: `SystemClock` only at the root (`run_agent_command`), handed to every part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from agent.certificate_source import CertificateSource, certificate_source_for
from agent.config import AgentConfig, ConfigError, add_agent_arguments
from agent.errors import AgentFailed, SocketPathRefused
from agent.file_mounted import FileSecretProvider, FileWatcher
from agent.file_output import FileOutput
from agent.metrics import AgentMetrics
from agent.sds import SdsServer, SecretResolver
from agent.secrets import SecretCache
from agent.status import build_status_server
from agent.workload import WorkloadApiServer
from meshca.clock import Clock, SystemClock
from meshca.files import ensure_dir
from meshca.listen import ListenError
from meshca.logs import configure_logging
from meshca.loop_heartbeat import LoopHeartbeat

__all__ = ["Agent", "AgentFailed", "main", "run_agent_command"]

log = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 4.0
CERTIFICATE_WORKER = "certificates"
# A node agent's Workload API: what one identity's pods may hold of the node's 1024 streams
# and 4096 relayed connections, so no pod can starve the others.
MAX_WORKLOAD_API_STREAMS_PER_CALLER = 64
MAX_WORKLOAD_API_CONNECTIONS_PER_CALLER = 256


class Agent:
    """The wired-up agent. `await start()`, then `await stop()`; or `await run(stop_event)`."""

    def __init__(self, config: AgentConfig, *, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.metrics = AgentMetrics(clock)
        self.cache = SecretCache()
        self.cache.add_listener(self.metrics.on_secret)
        self.cache.add_removal_listener(self.metrics.on_secret_removed)
        self.file_output: FileOutput | None = None
        if config.output_certs is not None:
            build = FileOutput.node if config.node_mode else FileOutput.single
            self.file_output = build(config.output_certs, clock)
            self.cache.add_listener(self.file_output.on_secret)
            self.cache.add_removal_listener(self.file_output.on_secret_removed)
        self.files = FileSecretProvider(
            FileWatcher(clock=clock, metrics=self.metrics),
            allowed_dirs=config.file_secret_dirs,
            forbidden_dirs=(config.output_certs,) if config.output_certs else (),
        )
        self.files.cache.add_listener(self.metrics.on_secret)
        self.files.cache.add_removal_listener(self.metrics.on_secret_removed)
        self.sds = SdsServer(
            SecretResolver(self.cache, self.files),
            str(config.sds_socket),
            metrics=self.metrics,
            socket_mode=config.sds_socket_mode,
        )
        self.certificates: CertificateSource = certificate_source_for(
            config, self.cache, clock, self.metrics, self.file_output
        )
        self.workload_api = _workload_api_for(
            config, self.cache, self.certificates, self.metrics, clock
        )
        # Readiness also says whether the loop is turning (a blocked loop serves nothing).
        self.heartbeat = LoopHeartbeat()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.status = build_status_server(
            config.status_host,
            config.status_port,
            self.certificates,
            self.metrics,
            clock,
            self.heartbeat,
            workload_api=self.workload_api.summary if self.workload_api is not None else None,
        )
        self._worker: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None
        self._failed = asyncio.Event()

    async def start(self) -> None:
        """Starts every part; a directory or socket that cannot be made is `AgentFailed`
        naming the flag (one line for the operator, not a traceback)."""
        directories = [("--sds-socket", self.config.sds_socket.parent)]
        if self.config.output_certs is not None:
            directories.append(("--output-dir", self.config.output_certs))
        for flag, directory in directories:
            try:
                ensure_dir(directory, 0o700)
            except OSError as exc:
                raise AgentFailed(
                    f"{flag}: cannot create the directory {directory}: {exc.strerror or exc}"
                ) from None
        self._heartbeat_task = asyncio.create_task(self.heartbeat.run(), name="loop-heartbeat")
        self.status.start()
        log.info("status server on %s (/healthz/ready, /metrics)", self.status.url)
        await _serve_socket("--sds-socket", self.config.sds_socket, self.sds.start)
        if self.workload_api is not None:
            await _serve_socket(
                "--workload-api-socket", self.workload_api.socket_path, self.workload_api.start
            )
        self._worker = asyncio.create_task(self.certificates.run(), name=CERTIFICATE_WORKER)
        self._worker.add_done_callback(self._on_worker_done)
        await self.certificates.start()

    def _on_worker_done(self, task: asyncio.Task[None]) -> None:
        """The worker runs until cancelled; one that ends otherwise is a bug: say so loudly and
        let `run()` stop the agent rather than serve a certificate that is no longer renewed."""
        if task.cancelled():
            return
        self.failure = task.exception() or RuntimeError(f"{task.get_name()} returned")
        log.critical(
            "the %s worker died; certificates are no longer renewed, stopping the agent",
            task.get_name(),
            exc_info=self.failure,
        )
        self._failed.set()

    async def stop(self) -> None:
        """Stops everything started within one shared deadline (`STOP_TIMEOUT_SECONDS`), each
        step also capped so a single slow step cannot starve the rest. Each server removes its
        own socket, and only the one it bound (`agent.unix_socket`): a start refused because
        another process serves on the path leaves that process's socket alone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_TIMEOUT_SECONDS
        step_cap = STOP_TIMEOUT_SECONDS / 4

        def time_left() -> float:
            return max(0.05, min(step_cap, deadline - loop.time()))

        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("certificate worker", self._stop_worker),
            ("SDS server", lambda: self.sds.stop(time_left() / 2)),
            ("Workload API server", self._stop_workload_api(time_left)),
            ("file watchers", self.files.stop),
            ("certificate source", self.certificates.close),
        ]
        for what, step in steps:
            try:
                await asyncio.wait_for(step(), time_left())
            except Exception as exc:
                log.warning("error stopping the %s: %s", what, exc or type(exc).__name__)
        await asyncio.to_thread(self.status.stop)
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()

    def _stop_workload_api(self, time_left: Callable[[], float]) -> Callable[[], Awaitable[None]]:
        async def stop() -> None:
            if self.workload_api is not None:
                await self.workload_api.stop(time_left() / 2)

        return stop

    async def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        worker.cancel()
        # A worker that died has been reported by `_on_worker_done` already.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await worker

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until `stop` is set; raises `AgentFailed` (after stopping) if a worker died.
        A start that fails half-way (a socket path taken) stops what it had started."""
        try:
            await self.start()
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._failed.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        finally:
            await self.stop()
        if self.failure is not None:
            raise AgentFailed(f"a background worker died: {self.failure!r}") from self.failure


async def _serve_socket(flag: str, path: Path, start: Callable[[], Awaitable[None]]) -> None:
    """Runs a socket server's `start`; a path it refuses or cannot listen on is `AgentFailed`,
    one line naming `flag`."""
    try:
        await start()
    except SocketPathRefused as exc:
        raise AgentFailed(f"{flag}: {exc}") from None
    except OSError as exc:
        raise AgentFailed(f"{flag} {path}: cannot listen there: {exc.strerror or exc}") from None


def _workload_api_for(
    config: AgentConfig,
    cache: SecretCache,
    certificates: CertificateSource,
    metrics: AgentMetrics,
    clock: Clock,
) -> WorkloadApiServer | None:
    """The Workload API server `config` asks for, if any: a pod agent serves its one identity on
    the socket itself; a node agent puts `agent.workload.relay` on the socket to attest callers."""
    if config.workload_api_socket is None:
        return None
    # JWT-SVIDs need a CA to sign them: not served for file-mounted certificates.
    jwt = certificates.jwt_svids
    if not config.node_mode:
        return WorkloadApiServer(
            cache,
            config.workload_api_socket,
            trust_domain=config.trust_domain,
            metrics=metrics,
            socket_mode=config.workload_api_socket_mode,
            jwt=jwt,
            own_identity=config.identity,
        )
    from agent.workload.attestor import NodeAttestor, NodeCaller
    from agent.workload.relay import PeerRelay

    pods = certificates.pods
    if pods is None:  # config refuses this combination; kept as a clear failure
        raise ConfigError("--workload-api-socket in node mode needs the pod watch")
    attestor = NodeAttestor(pods, config.trust_domain)
    relay = PeerRelay(
        config.workload_api_socket,
        attestor.pod_uid_of,
        socket_mode=config.workload_api_socket_mode,
        max_connections_per_caller=MAX_WORKLOAD_API_CONNECTIONS_PER_CALLER,
    )
    return WorkloadApiServer(
        cache,
        config.workload_api_socket,
        trust_domain=config.trust_domain,
        callers=NodeCaller(relay, attestor),
        metrics=metrics,
        socket_mode=config.workload_api_socket_mode,
        max_streams_per_caller=MAX_WORKLOAD_API_STREAMS_PER_CALLER,
        relay=relay,
        jwt=jwt,
    )


def run_agent_command(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Entry point for `meshca agent` (registered by `meshca.cli` via `add_agent_arguments`)."""
    try:
        config = AgentConfig.from_args(args, os.environ if environ is None else environ)
    except ConfigError as exc:
        configure_logging()
        log.error("invalid configuration: %s", exc)
        return 2
    configure_logging(config.log_level)
    try:
        asyncio.run(_run_until_signalled(config))
    except ConfigError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    except (AgentFailed, ListenError) as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:  # a socket it cannot serve on (agent.sds, agent.workload.api)
        log.error("cannot start the agent: %s", exc)
        return 1
    return 0


async def _run_until_signalled(config: AgentConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = Agent(config, clock=SystemClock())
    await agent.run(stop)
    log.info("agent stopped")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m agent.main`), for use before `meshca.cli` wires it in."""
    parser = argparse.ArgumentParser(prog="meshca agent", description=__doc__)
    add_agent_arguments(parser)
    return run_agent_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
