"""Assembles the CA from its configuration and runs it until SIGTERM.

Every choice between implementations (which authority source, which authenticators, which
impersonation policy) is made here, once, at start-up. Kubernetes mode (`CaConfig.kube` set:
`--kubeconfig`, or in-cluster credentials) swaps in the cluster-backed ones from
`ca_server.kube`: the root in Secret `istio-ca-secret` (unless a plugged-in CA is present),
TokenReview authentication, the node authorizer, and root ConfigMap publication.

How the process is served is chosen once too: the serving role (`ca_server.serving.role`), a
single CA or worker `slot` of `meshca ca --workers N`, supplies the gRPC server options, the
monitoring and debug HTTP servers (or, for a worker, the ready file and the status it publishes
to its supervisor); this module composes it with the authority and the services and never asks
which role it has.

Concurrency: one asyncio event loop runs the `grpc.aio` server and the authority watcher
(loading signing material, which may block on files or the API server, runs in a worker thread);
the monitoring HTTP server runs in its own thread and only reads a readiness flag and metrics.
Kubernetes mode adds its own threads (see `ca_server.kube`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc

from ca_server.admission import Admission
from ca_server.authn import Authenticator, AuthenticatorChain, ClientCertificateAuthenticator
from ca_server.authority_setup import record_expiry, set_up_authority
from ca_server.config import CaConfig
from ca_server.data_dir_guard import check_data_dir
from ca_server.dev_issuer import ensure_dev_issuer
from ca_server.impersonation import DenyImpersonation, ImpersonationPolicy
from ca_server.jwt_authn import JwtAuthenticator
from ca_server.kube.mode import KubernetesMode
from ca_server.metrics import CaMetrics
from ca_server.plugged_rotation import (
    PluggedChangeGuard,
    StrandingChangeError,
    audit_refusal,
    audit_reload,
)
from ca_server.report_service import (
    AgentReportService,
    TaintedSince,
    add_report_service,
    no_taints,
)
from ca_server.request_decoding import add_certificate_service
from ca_server.root_store import (
    AuthoritySource,
    CaSetupError,
    data_dir_lock,
    detect_plugged_ca,
    publish_root_bundle,
)
from ca_server.rotation import SlotSigner
from ca_server.service import CertificateService
from ca_server.serving.endpoints import Health, add_listening_port
from ca_server.serving.readiness import SigningReadiness
from ca_server.serving.role import ServingRole, ServingView, serving_role_for
from ca_server.serving.tls import ServingTls
from ca_server.signer import LocalSigner
from ca_server.wire import CERTIFICATE_SERVICE, REPORT_SERVICE
from certs import CertsError, SigningAuthority
from meshca.clock import Clock, SystemClock
from meshca.files import ensure_dir
from meshca.waiting import cancel_and_wait

log = logging.getLogger(__name__)


def authority_source_for(
    config: CaConfig, kube: KubernetesMode | None = None
) -> AuthoritySource | None:
    """Plugged-in CA when `--cacerts-dir` holds a complete layout; else `None`: self-signed
    authority slots (see `ca_server.authority_setup`)."""
    if config.cacerts_dir is not None:
        if not config.cacerts_dir.is_dir():
            what = "is not a directory" if config.cacerts_dir.exists() else "does not exist"
            raise CaSetupError(
                f"--cacerts-dir {config.cacerts_dir} {what}: give the directory holding the "
                "plugged-in CA's files, or leave the flag out for a self-signed root"
            )
        plugged = detect_plugged_ca(config.cacerts_dir)
        if plugged is not None:
            return plugged
        log.info("no plugged-in CA files in %s; using a self-signed root", config.cacerts_dir)
    return None


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


def tainted_since_for(signer: LocalSigner) -> TaintedSince:
    """What the agent report answers with: the taints of the slots this process follows (a
    plugged-in CA has none)."""
    if isinstance(signer, SlotSigner):
        return lambda: signer.state.tainted_since()
    return no_taints


def impersonation_policy_for(kube: KubernetesMode | None) -> ImpersonationPolicy:
    """The node authorizer when Kubernetes mode has trusted node accounts; else refuse."""
    return kube.impersonation_policy() if kube is not None else DenyImpersonation()


async def watch_authority(
    source: AuthoritySource,
    signer: LocalSigner,
    config: CaConfig,
    metrics: CaMetrics,
    clock: Clock,
    on_reload: Callable[[SigningAuthority], None] = lambda authority: None,
    guard: PluggedChangeGuard | None = None,
) -> None:
    """Re-reads the signing material when it changes (files, or the shared Secret); a broken
    update is refused and the current authority kept, so an operator's half-copied `cacerts`
    never stops issuance. `on_reload` passes a new root on (to the ConfigMap publisher);
    `guard` refuses a change that would strand workloads (see `ca_server.plugged_rotation`).

    Runs until cancelled: nothing the source or the reload steps raise may end it, or the CA
    would silently stop following its authority. Unusable material is logged once per change;
    any other failure (unreadable file, full disk, a bug) is logged and retried at the next poll.
    """
    seen = await asyncio.to_thread(source.fingerprint)
    while True:
        await clock.sleep(config.plugged_ca_poll_interval.total_seconds())
        try:
            if guard is not None:
                await asyncio.to_thread(guard.save, clock.now())
            seen = await _reload_if_changed(
                source, seen, signer, config, metrics, clock, on_reload, guard
            )
        except Exception:
            log.exception(
                "keeping the current CA: checking %s for changes failed; retrying",
                source.description,
            )


async def _reload_if_changed(
    source: AuthoritySource,
    seen: str,
    signer: LocalSigner,
    config: CaConfig,
    metrics: CaMetrics,
    clock: Clock,
    on_reload: Callable[[SigningAuthority], None],
    guard: PluggedChangeGuard | None = None,
) -> str:
    """One poll: reloads if the fingerprint moved from `seen`; returns the fingerprint handled."""
    current = await asyncio.to_thread(source.fingerprint)
    if current == seen:
        return seen
    try:
        authority = await asyncio.to_thread(source.load, clock.now())
        if guard is not None:
            await asyncio.to_thread(guard.check, signer.authority, authority, clock.now())
    except StrandingChangeError as exc:
        # Checked again at every poll: waiting (for leaves to expire) can make it acceptable.
        if guard is not None and guard.first_refusal(current, exc.reason):
            log.error("keeping the current CA: %s", exc)
            audit_refusal(exc)
        return seen
    except (CaSetupError, CertsError) as exc:
        log.error("keeping the current CA: the changed %s is unusable: %s", source.description, exc)
        return current
    signer.replace(authority)
    publish_root_bundle(config.data_dir, authority, {})  # a plugged-in CA has no taints
    record_expiry(metrics, authority)
    on_reload(authority)
    log.info(
        "reloaded %s; now signing with serial %x", source.description, authority.cert.serial_number
    )
    audit_reload(authority)
    return current


async def run_ca(config: CaConfig, clock: Clock | None = None) -> None:
    """Runs the CA until SIGTERM/SIGINT. Raises `CaSetupError` for unusable configuration."""
    clock = clock or SystemClock()
    role = serving_role_for(config)
    role.prepare()
    check_data_dir(config.data_dir)  # before anything there is trusted or written
    ensure_dir(config.data_dir)
    metrics = CaMetrics()
    kube = KubernetesMode(config, config.kube, metrics, clock) if config.kube is not None else None
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
    source = authority_source_for(config, kube)
    setup = await set_up_authority(config, source, metrics, clock, kube)
    signer, authority = setup.signer, setup.signer.authority
    if kube is not None:
        await kube.start(authority, tainted_since_for(signer))

    started = clock.now()
    readiness = SigningReadiness(lambda: signer.authority, clock)
    admission = Admission(config.admission, clock.monotonic)  # one policy: CSRs, then reports
    service = CertificateService(
        authenticators=build_authenticators(config, signer, clock, kube),
        impersonation=impersonation_policy_for(kube),
        signer=signer,
        ttl_policy=setup.ttl_policy,
        metrics=metrics,
        clock=clock,
        admission=admission,
        agent_reports=setup.agent_reports,
    )
    server = grpc.aio.server(options=role.server_options())
    add_certificate_service(service, server)
    if setup.agent_reports is not None:
        add_report_service(
            AgentReportService(
                authenticators=service.authenticators,
                reports=setup.agent_reports,
                tainted_since=tainted_since_for(signer),
                metrics=metrics,
                clock=clock,
                admission=admission,
            ),
            server,
        )
    health = Health(server, [CERTIFICATE_SERVICE, REPORT_SERVICE], checked=[CERTIFICATE_SERVICE])
    # Python's gRPC cannot ask for an *optional* client certificate, so renewal over mTLS gets
    # its own port (`--mtls-listen`) where the certificate is required and verified.
    tls = ServingTls(config, signer, clock, require_client_cert=False)
    add_listening_port(server, "--listen", config.listen, tls.credentials())
    if config.mtls_listen:
        mtls = ServingTls(config, signer, clock, require_client_cert=True)
        add_listening_port(server, "--mtls-listen", config.mtls_listen, mtls.credentials())
    report = setup.rotator.report if setup.rotator is not None else None
    role.start(
        ServingView(
            authority=lambda: signer.authority,
            leaves=metrics.leaves,
            slots=lambda: report.snapshot if report is not None else None,
            registry=metrics.registry,
            readiness=readiness,
            started=started,
            clock=clock,
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
    on_reload = kube.authority_changed if kube is not None else (lambda authority: None)
    validity = asyncio.create_task(readiness.watch(config.plugged_ca_poll_interval))
    if setup.rotator is not None:
        setup.rotator.on_change = on_reload
        watcher = asyncio.create_task(setup.rotator.run())
    else:
        assert source is not None
        watcher = asyncio.create_task(
            watch_authority(source, signer, config, metrics, clock, on_reload, setup.guard)
        )
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await cancel_and_wait(validity)  # before the role stops saying ready: it may rewrite it
        await role.leaving()
        await cancel_and_wait(watcher)
        await health.leaving()
        await server.stop(config.shutdown_grace.total_seconds())
        role.stop()
