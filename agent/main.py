"""`meshca agent`: composes the agent's parts and runs them until SIGTERM/SIGINT.

    token file -> IdentityResolver + FileTokenProvider -> CaClient -> SecretManager --+
    FILE_MOUNTED_CERTS: ./etc/certs/*.pem -> FileMountedSource -----------------------+ publish
                                                                                      v
        FileOutput (OUTPUT_CERTS) <- listener -- SecretCache --> SdsServer (Unix socket) -> Envoy
        AgentMetrics (expiry)     <- listener --'        file-cert:/file-root: names -'
        StatusServer (/healthz/ready, /metrics) reads the source's readiness + AgentMetrics

Node mode (`--node-mode`, ztunnel's pattern) replaces the SecretManager and the single
FileOutput:

    node-agent token -> CaClient (ImpersonatedIdentity) <- NodeSecretManager (priority queue,
    IdentitySource (pods on NODE_NAME | static list) --set_identities--^  N fetch workers)
        NodeSecretManager --publish spiffe://.../ns/NS/sa/SA + ROOTCA--> SecretCache --> SDS
        NodeFileOutput (OUTPUT/<ns>/<sa>/) and AgentMetrics <- listeners (publish and remove)

With OUTPUT_CERTS, the SecretManager first restores the certificate a previous run left there
(`agent.cert_state`), so a restart while the CA is down keeps serving.

Every choice between implementations (CA, node mode or file-mounted certificates) is made here,
once (the identity source inside node mode: `agent.node_identities.identity_source_for`).

Concurrency: one asyncio event loop runs the SecretManager worker (or the node manager's
fetch workers), its rotation timer, the CA
client and the SDS server; watchdog's observer thread hands file events to that loop; the
status server runs on its own thread (see `agent.status`). `Agent.stop()` stops everything,
each step bounded, and removes the SDS socket, so the process exits within 5 s of a signal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from agent.ca_client import CaClient
from agent.config import AgentConfig, ConfigError, add_agent_arguments
from agent.file_mounted import FileMountedSource, FileSecretProvider
from agent.file_output import FileOutput, NodeFileOutput
from agent.metrics import AgentMetrics
from agent.node_identities import IdentitySource, identity_source_for
from agent.node_secrets import NodeSecretManager
from agent.sds import SdsServer, SecretResolver
from agent.secret_manager import SecretManager
from agent.secrets import SecretCache
from agent.status import ReadinessSource, build_status_server
from agent.token import FileTokenProvider, IdentityResolver, TokenError
from meshca.clock import Clock, SystemClock
from meshca.files import ensure_dir
from meshca.logs import configure_logging

log = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 4.0


class AgentFailed(Exception):
    """A background worker (certificate rotation) died: the agent can no longer keep its
    certificates fresh, so it stops and exits non-zero for its supervisor to restart it."""


class Agent:
    """The wired-up agent. `await start()`, then `await stop()`; or `await run(stop_event)`."""

    def __init__(self, config: AgentConfig, *, clock: Clock | None = None) -> None:
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.metrics = AgentMetrics(self.clock)
        self.cache = SecretCache()
        self.cache.add_listener(self.metrics.on_secret)
        self.cache.add_removal_listener(self.metrics.on_secret_removed)
        self.file_output: FileOutput | NodeFileOutput | None = None
        if config.output_certs is not None:
            if config.node_mode:
                self.file_output = NodeFileOutput(config.output_certs, self.clock)
                self.cache.add_removal_listener(self.file_output.on_secret_removed)
            else:
                self.file_output = FileOutput(config.output_certs, self.clock)
            self.cache.add_listener(self.file_output.on_secret)
        self.files = FileSecretProvider(self.clock, metrics=self.metrics)
        self.files.cache.add_listener(self.metrics.on_secret)
        self.files.cache.add_removal_listener(self.metrics.on_secret_removed)
        self.sds = SdsServer(
            SecretResolver(self.cache, self.files),
            str(config.sds_socket),
            metrics=self.metrics,
            socket_mode=config.sds_socket_mode,
        )
        self.manager: SecretManager | None = None
        self.node_manager: NodeSecretManager | None = None
        self.identity_source: IdentitySource | None = None
        self.mounted: FileMountedSource | None = None
        self.ca_client: CaClient | None = None
        readiness: ReadinessSource
        if config.file_mounted_certs:
            directory = config.file_mounted_dir
            self.mounted = FileMountedSource(
                self.cache,
                directory / "cert-chain.pem",
                directory / "key.pem",
                directory / "root-cert.pem",
                self.clock,
                metrics=self.metrics,
            )
            readiness = self.mounted
        else:
            # In node mode this is the node agent's own token: it authenticates as itself and
            # impersonates the workloads on its node.
            tokens = FileTokenProvider(config.token_path, required=config.prov_cert is None)
            self.identity = IdentityResolver(config.identity, tokens, config.trust_domain)
            self.ca_client = CaClient(
                config.ca_addr,
                config.ca_root_ca,
                tokens,
                self.clock,
                cluster_id=config.cluster_id,
                extra_headers=config.ca_headers,
                timeout=config.ca_request_timeout,
                prov_cert=config.prov_cert,
                metrics=self.metrics,
            )
            if config.node_mode:
                self.identity_source = identity_source_for(config)
                self.node_manager = NodeSecretManager(
                    config, self.ca_client, self.cache, self.clock, metrics=self.metrics
                )
                readiness = self.node_manager
            else:
                self.manager = SecretManager(
                    config,
                    self.ca_client,
                    self.cache,
                    self.clock,
                    identity=self.identity,
                    metrics=self.metrics,
                    restore_from=config.output_certs,
                )
                readiness = self.manager
        self.status = build_status_server(
            config.status_host, config.status_port, readiness, self.metrics, self.clock
        )
        self._worker: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None
        self._failed = asyncio.Event()

    @property
    def secret_manager(self) -> SecretManager:
        """The SecretManager (not in file-mounted mode, where no CA is involved, nor in node
        mode, see `node_secret_manager`)."""
        if self.manager is None:
            raise RuntimeError(
                "this agent has no single-identity SecretManager (file-mounted or node mode)"
            )
        return self.manager

    @property
    def node_secret_manager(self) -> NodeSecretManager:
        if self.node_manager is None:
            raise RuntimeError("this agent is not in node mode (--node-mode)")
        return self.node_manager

    async def start(self) -> None:
        ensure_dir(self.config.sds_socket.parent, 0o700)
        if self.config.output_certs is not None:
            ensure_dir(self.config.output_certs, 0o700)
        self.status.start()
        log.info("status server on %s (/healthz/ready, /metrics)", self.status.url)
        await self.sds.start()
        if self.mounted is not None:
            log.info("serving file-mounted certificates from %s", self.config.file_mounted_dir)
            await self.mounted.start()
        if self.manager is not None:
            self._log_identity()
            self._start_worker(self.manager.run(), "secret-manager")
        if self.node_manager is not None and self.identity_source is not None:
            log.info(
                "node agent: identities from %s; CA at %s; up to %d fetches at once",
                self.identity_source.describe(),
                self.config.ca_addr,
                self.node_manager.max_concurrent,
            )
            self._start_worker(self.node_manager.run(), "node-secrets")
            self.identity_source.start(self.node_manager.set_identities)

    def _start_worker(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self._worker = asyncio.create_task(work, name=name)
        self._worker.add_done_callback(self._on_worker_done)

    def _on_worker_done(self, task: asyncio.Task[None]) -> None:
        """The workers run until cancelled; one that ends otherwise is a bug: say so loudly and
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
        step also capped so a single slow step cannot starve the rest; the socket goes last."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_TIMEOUT_SECONDS
        step_cap = STOP_TIMEOUT_SECONDS / 4

        def time_left() -> float:
            return max(0.05, min(step_cap, deadline - loop.time()))

        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        if self.identity_source is not None:
            steps.append(("identity source", self.identity_source.stop))
        if self._worker is not None:
            steps.append(("renewal worker", self._stop_worker))
        steps += [
            ("SDS server", lambda: self.sds.stop(time_left() / 2)),
            ("file watchers", self.files.stop),
        ]
        if self.mounted is not None:
            steps.append(("file-mounted source", self.mounted.stop))
        if self.manager is not None:
            steps.append(("secret manager", self.manager.aclose))
        if self.node_manager is not None:
            steps.append(("node secret manager", self.node_manager.aclose))
        if self.ca_client is not None:
            steps.append(("CA client", self.ca_client.close))
        for what, step in steps:
            try:
                await asyncio.wait_for(step(), time_left())
            except Exception as exc:
                log.warning("error stopping the %s: %s", what, exc or type(exc).__name__)
        await asyncio.to_thread(self.status.stop)
        with contextlib.suppress(FileNotFoundError):
            self.config.sds_socket.unlink()

    async def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        worker.cancel()
        # A worker that died has been reported by `_on_worker_done` already.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await worker

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until `stop` is set; raises `AgentFailed` (after stopping) if a worker died."""
        await self.start()
        try:
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

    def _log_identity(self) -> None:
        try:
            identity = self.identity()
        except (TokenError, ConfigError) as exc:
            log.warning("identity not known yet (%s); will retry", exc)
            return
        log.info("agent for %s; CA at %s", identity, self.config.ca_addr)


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
    except AgentFailed as exc:
        log.error("%s", exc)
        return 1
    return 0


async def _run_until_signalled(config: AgentConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = Agent(config)
    await agent.run(stop)
    log.info("agent stopped")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m agent.main`), for use before `meshca.cli` wires it in."""
    parser = argparse.ArgumentParser(prog="meshca agent", description=__doc__)
    add_agent_arguments(parser)
    return run_agent_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
