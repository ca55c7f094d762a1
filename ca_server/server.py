"""Assembles the CA from its configuration and runs it until SIGTERM.

Every choice between implementations is made once, at start-up: the authority driver
(self-signed or plugged-in) by `ca_server.authority.authority_driver_for`, which this module
holds without asking its kind; the authenticators and the impersonation policy here. The fleet's
table of agent reports (`ca_server.fleet.AgentReports`) is built here once and handed to the
driver (which publishes it with its leaf ledger) and to both services (which record into it).
Kubernetes mode (`CaConfig.kube` set: `--kubeconfig`, or in-cluster credentials) swaps in the
cluster-backed ones from `ca_server.kube`: the root in Secret `istio-ca-secret` (unless a
plugged-in CA is present), TokenReview authentication, the node authorizer, and root ConfigMap
publication.

How the process is served is chosen once too: the serving role (`ca_server.serving.role`), a
single CA or worker `slot` of `meshca ca --workers N`, supplies the gRPC server options, the
monitoring and debug HTTP servers (or, for a worker, the ready file and the status it publishes
to its supervisor); this module composes it with the authority and the services and never asks
which role it has.

Concurrency: one asyncio event loop runs the authority driver (loading signing material, which
may block on files or the API server, runs in a worker thread) and the requests that wait on
I/O; the gRPC server (`ca_server.serving.cq_server`) answers the others on its own thread;
the monitoring HTTP server runs in its own thread and only reads a readiness flag and metrics.
Kubernetes mode adds its own threads (see `ca_server.kube`).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from ca_server.admission import Admission
from ca_server.authn import Authenticator, AuthenticatorChain, ClientCertificateAuthenticator
from ca_server.authority import (
    LocalSigner,
    authority_driver_for,
    check_data_dir,
    data_dir_lock,
    sweep_stale_temporaries,
)
from ca_server.config import CaConfig
from ca_server.dev_issuer import ensure_dev_issuer
from ca_server.fleet import AgentReports
from ca_server.impersonation import DenyImpersonation, ImpersonationPolicy
from ca_server.jwt_authn import JwtAuthenticator
from ca_server.jwt_svid import (
    JwtSvidService,
    add_jwt_svid_service,
    discovery_server,
    jwt_authority_for,
    status_section,
)
from ca_server.kube.caches import KubeCacheCollector, readiness_lines
from ca_server.kube.mode import KubernetesMode
from ca_server.kube.watched_cache import CacheProgress
from ca_server.metrics import CaMetrics
from ca_server.report_service import AgentReportService, add_report_service
from ca_server.request_decoding import add_certificate_service
from ca_server.service import CertificateService
from ca_server.serving.cq_server import rpc_server_for
from ca_server.serving.endpoints import Health, add_listening_port
from ca_server.serving.readiness import SigningReadiness
from ca_server.serving.role import ServingRole, ServingView, serving_role_for
from ca_server.serving.tls import ServingTls
from ca_server.wire import CERTIFICATE_SERVICE, REPORT_SERVICE
from meshca.clock import Clock, SystemClock
from meshca.files import ensure_dir
from meshca.waiting import cancel_and_wait

log = logging.getLogger(__name__)


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
            config.trust_domain,
            lambda: signer.trusted_client_roots,
            clock,
            lambda: signer.tainted_authorities,
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


async def run_ca(config: CaConfig, clock: Clock | None = None) -> None:
    """Runs the CA until SIGTERM/SIGINT. Raises `CaSetupError` for unusable configuration."""
    clock = clock or SystemClock()
    role = serving_role_for(config)
    role.prepare()
    check_data_dir(config.data_dir)  # before anything there is trusted or written
    ensure_dir(config.data_dir)
    # In every mode: Kubernetes mode keeps its root bundle, taint notice and ledgers here too
    # (local mode's state store sweeps again at its first write; a live writer's file is
    # locked and spared).
    sweep_stale_temporaries(config.data_dir)
    metrics = CaMetrics()
    kube = KubernetesMode(config, config.kube, metrics, clock) if config.kube is not None else None
    if kube is not None and kube.caches is not None and kube.caches.any:
        metrics.registry.register(KubeCacheCollector(kube.caches.progress))
    try:
        await _serve(config, clock, metrics, kube, role)
    finally:
        if kube is not None:
            await kube.stop()


async def _serve(
    config: CaConfig,
    clock: Clock,
    metrics: CaMetrics,
    kube: KubernetesMode | None,
    role: ServingRole,
) -> None:
    # This process's agent reports, keyed on pods the informer can say are gone (Kubernetes mode).
    agent_reports = AgentReports(pods=kube.report_pods() if kube is not None else None)
    driver = authority_driver_for(config, metrics, clock, agent_reports, kube)
    await driver.start()
    signer = driver.signer
    jwt_authority = jwt_authority_for(
        config,
        clock,
        kube.clients.local if kube is not None else None,
        fleet=driver.agents,
        registry=metrics.registry,
    )
    await jwt_authority.start()
    oidc = (
        discovery_server(config.jwt.oidc_listen, jwt_authority, config.jwt.jwks_max_age)
        if config.jwt.oidc_listen  # a worker's is "": its supervisor serves discovery
        else None
    )
    if kube is not None:
        await kube.start(signer.authority, driver.tainted_since, driver.root_phases)
        kube.sign_pod_certificates(signer, driver.ttl_policy, driver.planned_handover)

    started = clock.now()
    readiness = SigningReadiness(lambda: signer.authority, clock)
    admission = Admission(config.admission, clock.monotonic)  # one policy: CSRs, then reports
    service = CertificateService(
        authenticators=build_authenticators(config, signer, clock, kube),
        impersonation=impersonation_policy_for(kube),
        signer=signer,
        ttl_policy=driver.ttl_policy,
        metrics=metrics,
        clock=clock,
        admission=admission,
        agent_reports=agent_reports,
    )
    server = rpc_server_for(config.rpc_server, role.server_options())
    add_certificate_service(service, server)
    add_report_service(
        AgentReportService(
            authenticators=service.authenticators,
            reports=agent_reports,
            tainted_since=driver.tainted_since,
            metrics=metrics,
            clock=clock,
            admission=admission,
        ),
        server,
    )
    add_jwt_svid_service(
        JwtSvidService(
            authority=jwt_authority,
            authenticators=service.authenticators,
            impersonation=impersonation_policy_for(kube),
            admission=admission,
            trust_domain=config.trust_domain,
        ),
        server,
    )
    health = Health(
        server,
        [CERTIFICATE_SERVICE, REPORT_SERVICE],
        checked=[CERTIFICATE_SERVICE],
        monotonic=clock.monotonic,
    )
    # Python's gRPC cannot ask for an *optional* client certificate, so renewal over mTLS gets
    # its own port (`--mtls-listen`) where the certificate is required and verified.
    tls = ServingTls(config, signer, clock, require_client_cert=False)
    add_listening_port(server, "--listen", config.listen, tls.credentials())
    if config.mtls_listen:
        mtls = ServingTls(config, signer, clock, require_client_cert=True)
        add_listening_port(server, "--mtls-listen", config.mtls_listen, mtls.credentials())
    report = driver.report

    def caches() -> list[CacheProgress]:
        return kube.cache_progress() if kube is not None else []

    role.start(
        ServingView(
            authority=lambda: signer.authority,
            leaves=metrics.leaves,
            slots=lambda: report.snapshot if report is not None else None,
            registry=metrics.registry,
            readiness=readiness,
            started=started,
            clock=clock,
            caches_synced=lambda: all(item.synced for item in caches()),
            detail=lambda: readiness_lines(caches()),
            jwt=lambda: status_section(
                jwt_authority.state,
                jwt_authority.issuer,
                oidc.url if oidc is not None else None,
                config.jwt.jwks_max_age,
                jwt_authority.coverage.by_kid() if jwt_authority.coverage else None,
            ),
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    await health.serving()
    await role.serving()
    log.info(
        "CA serving on %s%s; monitoring on %s%s",
        config.listen,
        f" and mTLS on {config.mtls_listen}" if config.mtls_listen else "",
        config.monitoring_listen,
        f"; debug (/debug/ca) on {config.debug_listen}" if config.debug_listen else "",
    )
    if kube is not None:
        driver.on_change = kube.authority_changed
    validity = asyncio.create_task(readiness.watch(config.plugged_ca_poll_interval))
    watcher = asyncio.create_task(driver.run())
    jwt_keys = asyncio.create_task(jwt_authority.run())
    if oidc is not None:
        oidc.start()
        log.info("OIDC discovery on %s (issuer %s)", oidc.url, jwt_authority.issuer)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await cancel_and_wait(validity)  # before the role stops saying ready: it may rewrite it
        await role.leaving()
        await cancel_and_wait(watcher)
        await cancel_and_wait(jwt_keys)
        if oidc is not None:
            oidc.stop()
        await health.leaving()
        await server.stop(config.shutdown_grace.total_seconds())
        role.stop()
