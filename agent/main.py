"""`meshca agent`: composes the agent's parts and runs them until SIGTERM/SIGINT.

    token file -> IdentityResolver + FileTokenProvider -> CaClient -> SecretManager
                                                                        | publish
                                                                        v
                      FileOutput (OUTPUT_CERTS) <- listener -- SecretCache --> SDS server(s)
                      StatusServer (/healthz/ready, /metrics) reads SecretManager + AgentMetrics

Concurrency: one asyncio event loop runs the SecretManager worker, its rotation timer, the CA
client and the SDS server(s); the status server runs on its own thread (see `agent.status`).
`Agent.stop()` cancels the worker, stops the servers and removes the SDS socket, all bounded so
the process exits within 5 s of a signal.

SDS plugs in at `consumer_servers()`: the one place that decides which servers read the cache.
`agent.sds.SdsServer(cache, socket_path, metrics)` is started there when that module is present
in the build; it must offer `async start()` and `async stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
from collections.abc import Mapping
from typing import Protocol

from agent.ca_client import CaClient
from agent.config import AgentConfig, ConfigError, add_agent_arguments
from agent.file_output import FileOutput
from agent.metrics import AgentMetrics
from agent.secret_manager import SecretManager
from agent.secrets import SecretCache
from agent.status import StatusServer
from agent.token import FileTokenProvider, IdentityResolver, TokenError
from meshca.clock import Clock, SystemClock
from meshca.files import ensure_dir
from meshca.logs import configure_logging

log = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 4.0


class Server(Protocol):
    """Something that serves the cache's secrets to consumers (SDS over a Unix socket)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def consumer_servers(
    config: AgentConfig, cache: SecretCache, metrics: AgentMetrics
) -> list[Server]:
    """The servers started alongside the SecretManager. SDS comes from `agent.sds` when that
    module is part of the build; without it the agent still writes files and reports status."""
    try:
        sds = importlib.import_module("agent.sds")
    except ModuleNotFoundError as exc:
        if exc.name != "agent.sds":
            raise
        log.warning("this build has no SDS server (agent.sds); serving files and status only")
        return []
    server: Server = sds.SdsServer(cache, config.sds_socket, metrics)
    return [server]


class Agent:
    """The wired-up agent. `await start()`, then `await stop()`; or `await run(stop_event)`."""

    def __init__(self, config: AgentConfig, *, clock: Clock | None = None) -> None:
        if config.file_mounted_certs:
            raise ConfigError(
                "FILE_MOUNTED_CERTS=true is served by agent.file_mounted, which this command "
                "does not start yet; unset it to get certificates from the CA"
            )
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.metrics = AgentMetrics(self.clock)
        self.cache = SecretCache()
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
        self.manager = SecretManager(
            config,
            self.ca_client,
            self.cache,
            self.clock,
            identity=self.identity,
            metrics=self.metrics,
        )
        self.file_output: FileOutput | None = None
        if config.output_certs is not None:
            self.file_output = FileOutput(config.output_certs, self.clock)
            self.cache.add_listener(self.file_output.on_secret)
        self.status = StatusServer(
            config.status_host, config.status_port, self.manager, self.metrics, self.clock
        )
        self.servers: list[Server] = []
        self._worker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ensure_dir(self.config.sds_socket.parent, 0o700)
        if self.config.output_certs is not None:
            ensure_dir(self.config.output_certs, 0o700)
        self._log_identity()
        self.status.start()
        self.servers = consumer_servers(self.config, self.cache, self.metrics)
        for server in self.servers:
            await server.start()
        self._worker = asyncio.create_task(self.manager.run(), name="secret-manager")

    async def stop(self) -> None:
        """Stops everything started, each step bounded so shutdown cannot hang."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(self._worker, STOP_TIMEOUT_SECONDS / 4)
            self._worker = None
        await self.manager.aclose()
        for server in reversed(self.servers):
            try:
                await asyncio.wait_for(server.stop(), STOP_TIMEOUT_SECONDS / 4)
            except Exception as exc:
                log.warning("error stopping %s: %s", type(server).__name__, exc)
        self.servers = []
        await asyncio.to_thread(self.status.stop)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.ca_client.close(), STOP_TIMEOUT_SECONDS / 4)
        with contextlib.suppress(FileNotFoundError):
            self.config.sds_socket.unlink()

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

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
