"""Assembles the CA from its configuration and runs it until SIGTERM.

Every choice between implementations is made once, at start-up: the authority driver
(self-signed or plugged-in) by `ca_server.authority.authority_driver_for`, which this module
holds without asking its kind; the authenticators and the impersonation policy here.
Kubernetes mode (`CaConfig.kube` set: `--kubeconfig`, or in-cluster credentials) swaps in the
cluster-backed ones from `ca_server.kube`: the root in Secret `istio-ca-secret` (unless a
plugged-in CA is present), TokenReview authentication, the node authorizer, and root ConfigMap
publication.

Concurrency: one asyncio event loop runs the `grpc.aio` server and the authority driver
(loading signing material, which may block on files or the API server, runs in a worker thread);
the monitoring HTTP server runs in its own thread and only reads a readiness flag and metrics.
Kubernetes mode adds its own threads (see `ca_server.kube`).

As worker `slot` of `meshca ca --workers N` (`CaConfig.worker` set; see `ca_server.workers`)
the same assembly serves the same ports as its siblings (`SO_REUSEPORT`: the kernel spreads
connections across the workers), leaves `/metrics`, `/ready` and `/debug/ca` (on
`--debug-listen`) to the supervisor (publishing its part of `/debug/ca`:
`ca_server.worker_status`), and tells it that it is serving
by creating its ready file. A worker dies with its supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from datetime import datetime

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ca_server.admission import Admission
from ca_server.authn import Authenticator, AuthenticatorChain, ClientCertificateAuthenticator
from ca_server.authority import (
    AuthorityReport,
    LocalSigner,
    authority_driver_for,
    check_data_dir,
    data_dir_lock,
    report_section,
)
from ca_server.config import CaConfig
from ca_server.dev_issuer import ensure_dev_issuer
from ca_server.impersonation import DenyImpersonation, ImpersonationPolicy
from ca_server.jwt_authn import JwtAuthenticator
from ca_server.kube.mode import KubernetesMode
from ca_server.metrics import CaMetrics
from ca_server.readiness import SigningReadiness
from ca_server.report_service import SERVICE_NAME as REPORT_SERVICE_NAME
from ca_server.report_service import AgentReportService, add_report_service
from ca_server.request_decoding import add_certificate_service
from ca_server.service import CertificateService
from ca_server.serving_tls import ServingTls
from ca_server.status import ca_document
from ca_server.worker_status import WorkerStatusPublisher
from ca_server.workers import die_with_parent
from meshca.clock import Clock, SystemClock
from meshca.files import atomic_write, ensure_dir
from meshca.listen import ListenError
from meshca.status_http import StatusServer, json_response, metrics_route, text
from meshca.waiting import cancel_and_wait
from meshca_proto import ca_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"].full_name
_MAX_MESSAGE_BYTES = 1024 * 1024


def build_authenticators(
    config: CaConfig, signer: LocalSigner, clock: Clock, kube: KubernetesMode | None = None
) -> AuthenticatorChain:
    """In Istio's order: client certificate, JWKS issuers (if any), the cluster's tokens
    (TokenReview, or offline against the issuer keys and the pod informer)."""
    issuers = list(config.jwt_issuers)
    if config.trust_dev_issuer:
        with data_dir_lock(config.data_dir):
            issuers.append(ensure_dev_issuer(config.data_dir).trust_config())
    chain: list[Authenticator] = [
        ClientCertificateAuthenticator(
            config.trust_domain, lambda: signer.trusted_client_roots, clock
        ),
    ]
    if issuers:
        chain.append(JwtAuthenticator.from_config(issuers, config.trust_domain, clock))
    if kube is not None:
        chain.extend(kube.token_authenticators())
    return AuthenticatorChain(chain)


def impersonation_policy_for(kube: KubernetesMode | None) -> ImpersonationPolicy:
    """The node authorizer when Kubernetes mode has trusted node accounts; else refuse."""
    return kube.impersonation_policy() if kube is not None else DenyImpersonation()


@dataclass
class CaState:
    signing: SigningReadiness
    ready: bool = False

    def readiness(self) -> tuple[int, str]:
        """`/ready`: 200 once serving, while the signing chain is valid; else 503 and why."""
        if not self.ready:
            return 503, "starting\n"
        problem = self.signing.problem()
        return (503, f"not ready: {problem}\n") if problem else (200, "ready\n")


async def run_ca(config: CaConfig, clock: Clock | None = None) -> None:
    """Runs the CA until SIGTERM/SIGINT. Raises `CaSetupError` for unusable configuration."""
    clock = clock or SystemClock()
    if config.worker is not None:
        die_with_parent()
    check_data_dir(config.data_dir)  # before anything there is trusted or written
    ensure_dir(config.data_dir)
    metrics = CaMetrics()
    kube = KubernetesMode(config, config.kube, metrics, clock) if config.kube is not None else None
    try:
        await _serve(config, clock, metrics, kube)
    finally:
        if kube is not None:
            await kube.stop()


async def _serve(
    config: CaConfig, clock: Clock, metrics: CaMetrics, kube: KubernetesMode | None
) -> None:
    driver = authority_driver_for(config, metrics, clock, kube)
    await driver.start()
    signer = driver.signer
    if kube is not None:
        await kube.start(signer.authority, driver.tainted_since)

    started = clock.now()
    state = CaState(signing=SigningReadiness(lambda: signer.authority, clock))
    admission = Admission(config.admission, clock.monotonic)  # one policy: CSRs, then reports
    service = CertificateService(
        authenticators=build_authenticators(config, signer, clock, kube),
        impersonation=impersonation_policy_for(kube),
        signer=signer,
        ttl_policy=driver.ttl_policy,
        metrics=metrics,
        clock=clock,
        admission=admission,
        agent_reports=driver.agent_reports,
    )
    server = grpc.aio.server(options=server_options(config))
    add_certificate_service(service, server)
    add_report_service(
        AgentReportService(
            authenticators=service.authenticators,
            reports=driver.agent_reports,
            tainted_since=driver.tainted_since,
            metrics=metrics,
            clock=clock,
            admission=admission,
        ),
        server,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, REPORT_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    # Python's gRPC cannot ask for an *optional* client certificate, so renewal over mTLS gets
    # its own port (`--mtls-listen`) where the certificate is required and verified.
    tls = ServingTls(config, signer, clock, require_client_cert=False)
    add_listening_port(server, "--listen", config.listen, tls.credentials())
    if config.mtls_listen:
        mtls = ServingTls(config, signer, clock, require_client_cert=True)
        add_listening_port(server, "--mtls-listen", config.mtls_listen, mtls.credentials())
    report = driver.report
    monitoring = _monitoring(config, metrics, state)
    debug = _debug(config, metrics, signer, started, clock, report)
    for http in (monitoring, debug):
        if http is not None:
            http.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    publisher: WorkerStatusPublisher | None = None
    publishing: asyncio.Task[None] | None = None
    if config.worker is not None:
        # Published before the ready file, so the supervisor's `/debug/ca` answers once
        # `/ready` does.
        publisher = WorkerStatusPublisher(
            config.worker.status_file, signer, metrics.leaves, clock, report=report
        )
        await asyncio.to_thread(publisher.publish)
        publishing = asyncio.create_task(publisher.run())
    state.ready = True
    if config.worker is not None:
        ready_file = config.worker.ready_file
        atomic_write(ready_file, ready_file_text(None))
        state.signing.on_change = lambda problem: atomic_write(ready_file, ready_file_text(problem))
    log.info(
        "CA serving on %s%s; monitoring on %s%s",
        config.listen,
        f" and mTLS on {config.mtls_listen}" if config.mtls_listen else "",
        config.monitoring_listen,
        f"; debug (/debug/ca) on {config.debug_listen}" if config.debug_listen else "",
    )
    if kube is not None:
        driver.on_change = kube.authority_changed
    validity = asyncio.create_task(state.signing.watch(config.plugged_ca_poll_interval))
    watcher = asyncio.create_task(driver.run())
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await cancel_and_wait(validity)  # before the ready file goes: it may rewrite it
        state.ready = False
        if config.worker is not None:
            config.worker.ready_file.unlink(missing_ok=True)
        for task in (watcher, publishing):
            await cancel_and_wait(task)
        if publisher is not None:
            publisher.remove()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.shutdown_grace.total_seconds())
        for http in (monitoring, debug):
            if http is not None:
                http.stop()


def ready_file_text(problem: str | None) -> bytes:
    """A worker's ready file: its pid, then why it is not ready (read by `workers._Slot`)."""
    return f"{os.getpid()}\n{f'not ready: {problem}' if problem else ''}\n".encode()


def server_options(config: CaConfig) -> list[tuple[str, int]]:
    """A single CA owns its ports (a second one on the same port fails to start, loudly);
    workers share theirs with their siblings."""
    return [
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 1 if config.worker is not None else 0),
    ]


def _monitoring(config: CaConfig, metrics: CaMetrics, state: CaState) -> StatusServer | None:
    """`/metrics`, `/healthz` and `/ready` of a single CA; a worker's are served by its
    supervisor. No identities or serials here: those are on the debug address only."""
    if config.worker is not None:
        return None
    return StatusServer(
        config.monitoring_listen,
        {
            "/metrics": metrics_route(metrics.registry),
            "/healthz": lambda: text(200, "ok\n"),
            "/ready": lambda: text(*state.readiness()),
        },
    )


def _debug(
    config: CaConfig,
    metrics: CaMetrics,
    signer: LocalSigner,
    started: datetime,
    clock: Clock,
    report: AuthorityReport | None = None,
) -> StatusServer | None:
    """`/debug/ca` (workload identities and serials, what `meshca status` reads) and `/metrics`
    (its rates) on `--debug-listen`, only when given; a worker's are served by its supervisor.
    `report` holds the authority slots (self-signed slots only)."""
    if config.worker is not None or config.debug_listen is None:
        return None
    return StatusServer(
        config.debug_listen,
        {
            "/metrics": metrics_route(metrics.registry),
            "/debug/ca": lambda: json_response(
                ca_document(
                    signer.authority, metrics.leaves, started, clock.now(), report_section(report)
                )
            ),
        },
        name="debug",
        flag="--debug-listen",
    )


def add_listening_port(
    server: grpc.aio.Server, flag: str, address: str, credentials: grpc.ServerCredentials
) -> None:
    """`add_secure_port`, with a failure to bind said as one line naming the flag."""
    try:
        server.add_secure_port(address, credentials)
    except RuntimeError:
        raise ListenError(
            f"{flag} {address}: cannot listen there (the port is in use, or not an address of "
            "this host): stop what holds it or pick another port"
        ) from None
