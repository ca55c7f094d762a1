"""Where the agent's certificates come from: one `CertificateSource`, chosen once from config.

    CertificateSource (protocol)           start · run · close · has_valid_certificate · last_error
                                           · pods (node agent watching pods: its pods by UID)
    ├── CaCertificateSource                an identity source feeding `agent.scheduler`, CA-backed
    │     + `agent.trust_bundle`: the served ROOTCA from the watched root file and CA answers
    │     + `agent.taint_file`: the CA's taint notice beside the root file -> scheduler
    │     + `agent.reporter`: the periodic report to the CA; its answer's taints -> scheduler
    │     + `agent.identity_sources`: which identities (one source, chosen once)
    │     pod agent:  SingleIdentitySource -> default        (restores from OUTPUT/)
    │     node agent: pods on the node | static list -> SPIFFE IDs, by impersonation
    │                                                        (restores from OUTPUT/<ns>/<sa>/)
    └── agent.file_mounted.FileMountedSource   FILE_MOUNTED_CERTS: files, no CA (Istio's three
                                               files, or the kubelet's credential bundle)

`certificate_source_for()` is the one place that choice is made; `agent.main.Agent` holds the
result and never asks which kind it has. Both publish into the agent's `SecretCache`.

Concurrency: `start()` and `close()` run on the event loop; `run()` is the long-running worker
the Agent supervises (it must not return: a source that stops renewing stops the agent).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from agent.ca_client import CaClient
from agent.config import AgentConfig
from agent.file_mounted import FileMountedSource, FileWatcher
from agent.file_output import FileOutput
from agent.identity_source import IdentitySource
from agent.identity_sources import identity_source_for
from agent.jwt_svids import JwtSvidSource
from agent.metrics import AgentMetrics
from agent.propagation import PropagationReport, new_agent_id
from agent.reporter import PeriodicReporter
from agent.scheduler import CertificateScheduler
from agent.secrets import SecretCache
from agent.taint_file import TaintFileWatch, taint_notice_beside
from agent.token import FileTokenProvider
from agent.trust_bundle import RootFileWatch, TrustBundleKeeper
from meshca.clock import Clock
from meshca.waiting import cancel_and_wait

if TYPE_CHECKING:
    from agent.workload.attestor import PodDirectory

log = logging.getLogger(__name__)


class CertificateSource(Protocol):
    """What the Agent needs from wherever its certificates come from."""

    async def start(self) -> None:
        """Begins publishing into the cache (returns quickly)."""
        ...

    async def run(self) -> None:
        """The worker: keeps certificates fresh until cancelled."""
        ...

    async def close(self) -> None:
        """Stops everything `start` began (the `run()` task is cancelled by its owner)."""
        ...

    def has_valid_certificate(self, now: datetime | None = None) -> bool: ...

    @property
    def last_error(self) -> str | None: ...

    @property
    def pods(self) -> PodDirectory | None:
        """The node's pods by UID when the source watches them (the Workload API's attestor
        places callers with it), else None."""
        ...

    @property
    def jwt_svids(self) -> JwtSvidSource | None:
        """The Workload API's JWT-SVIDs (signed by the CA; their bundle is in the periodic
        report), or None when the certificates are file-mounted (no CA: not served)."""
        ...


class CaCertificateSource:
    """Certificates from the CA: an identity source feeding the scheduler."""

    def __init__(
        self,
        scheduler: CertificateScheduler,
        identities: IdentitySource,
        ca_client: CaClient,
        trust_bundle: TrustBundleKeeper,
        *,
        root_file: RootFileWatch | None,
        reporter: PeriodicReporter | None,
        taint_file: TaintFileWatch | None,
        jwt_svids: JwtSvidSource,
    ) -> None:
        self.scheduler = scheduler
        self.identities = identities
        self.ca_client = ca_client
        self.trust_bundle = trust_bundle
        self.root_file = root_file
        self.reporter = reporter
        self.taint_file = taint_file
        self.jwt_svids: JwtSvidSource | None = jwt_svids

    @property
    def pods(self) -> PodDirectory | None:
        from agent.node_identities import PodIdentitySource

        return self.identities if isinstance(self.identities, PodIdentitySource) else None

    async def start(self) -> None:
        log.info(
            "certificates for %s from the CA at %s; up to %d fetches at once",
            self.identities.describe(),
            self.ca_client.addr,
            self.scheduler.max_concurrent,
        )
        if self.root_file is not None:  # the file's bundle first, before any CA answer
            await self.root_file.start()
        if self.taint_file is not None:  # known taints apply to restored leaves too
            await self.taint_file.start()
        self.identities.start(self.scheduler.set_identities)

    async def run(self) -> None:
        """The scheduler's workers, and beside them the periodic report (which may end by
        itself: a CA that takes no reports; certificates never depend on it)."""
        reporting = None
        if self.reporter is not None:
            reporting = asyncio.create_task(self.reporter.run(), name="agent-report")
            reporting.add_done_callback(_log_report_crash)
        try:
            await self.scheduler.run()
        finally:
            await cancel_and_wait(reporting)

    async def close(self) -> None:
        if self.root_file is not None:
            await self.root_file.stop()
        if self.taint_file is not None:
            await self.taint_file.stop()
        await self.identities.stop()
        await self.scheduler.aclose()
        await self.ca_client.close()

    def has_valid_certificate(self, now: datetime | None = None) -> bool:
        return self.scheduler.has_valid_certificate(now)

    @property
    def last_error(self) -> str | None:
        return self.scheduler.last_error


def _log_report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "the agent report stopped; certificates are unaffected", exc_info=task.exception()
        )


def certificate_source_for(
    config: AgentConfig,
    cache: SecretCache,
    clock: Clock,
    metrics: AgentMetrics,
    file_output: FileOutput | None,
) -> CertificateSource:
    """The agent's one certificate source for `config` (see the module docstring)."""
    if config.file_mounted_certs:
        directory = config.file_mounted_dir
        return FileMountedSource(
            cache,
            FileWatcher(clock=clock, metrics=metrics),
            directory / "cert-chain.pem",
            directory / "key.pem",
            directory / "root-cert.pem",
            credential_bundle=config.credential_bundle,
        )
    # In node mode this is the node agent's own token: it authenticates as itself and
    # impersonates the workloads on its node.
    tokens = FileTokenProvider(config.token_path, required=config.prov_cert is None)
    trust_bundle = TrustBundleKeeper(cache, clock, metrics)
    agent_name = config.node_name if config.node_mode else config.pod_name
    report = PropagationReport(new_agent_id(agent_name), lambda: trust_bundle.digest)
    ca_client = CaClient(
        config.ca_addr,
        config.ca_root_ca,
        tokens,
        clock,
        metrics=metrics,
        cluster_id=config.cluster_id,
        extra_headers=config.ca_headers,
        timeout=config.ca_request_timeout,
        prov_cert=config.prov_cert,
        report=report,
    )
    scheduler = CertificateScheduler.from_config(
        config,
        ca_client,
        cache,
        clock,
        metrics=metrics,
        trust_bundle=trust_bundle,
        start_hook=file_output.restore if file_output is not None else None,
    )
    root_file: RootFileWatch | None = None
    taint_file: TaintFileWatch | None = None
    if config.ca_root_ca is not None:  # with the OS roots (SYSTEM) the CA's TLS is not ours
        trust_bundle.add_trust_listener(ca_client.trust)
        interval = config.root_file_poll_interval.total_seconds()
        root_file = RootFileWatch(
            config.ca_root_ca, trust_bundle, clock, metrics, interval=interval
        )
        # The CA publishes its taint notice beside its bundle.
        taint_file = TaintFileWatch(
            taint_notice_beside(config.ca_root_ca),
            scheduler.taints_learned,
            clock,
            metrics,
            interval=interval,
        )
    identities = identity_source_for(
        config, tokens, clock, scheduler.policy.backoff, scheduler.source_failed
    )
    jwt_svids = JwtSvidSource(ca_client, clock)
    reporter = None
    if config.report_interval:
        reporter = PeriodicReporter(
            ca_client, scheduler, report, clock, config.report_interval, metrics, jwt=jwt_svids
        )
    return CaCertificateSource(
        scheduler,
        identities,
        ca_client,
        trust_bundle,
        root_file=root_file,
        reporter=reporter,
        taint_file=taint_file,
        jwt_svids=jwt_svids,
    )
