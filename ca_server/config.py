"""The CA's configuration: one typed object built once from flags, then passed down.

`ca_server.flags.add_ca_arguments` registers `meshca ca`'s flags; `CaConfig.from_args(args,
environ)` merges them over Istio's environment variables (`POD_NAMESPACE`, `CLUSTER_ID`,
`CA_TRUSTED_NODE_ACCOUNTS`, `POD_NAME`, `KUBERNETES_SERVICE_HOST`) and the defaults, and checks
what the flags mean together. The environment is handed in, so nothing below reads
`os.environ` and tests can pass a dict — the same shape as `agent.config`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Literal

from ca_server.wire import CA_SERVING_HOSTS
from certs import DEFAULT_TRUST_DOMAIN, KeySpec, SpiffeId, format_duration
from certs.errors import SpiffeIdError
from meshca.accounts import parse_account_list
from meshca.listen import parse_listen

DEFAULT_AUDIENCE = "istio-ca"
DEFAULT_SERVING_HOSTS = CA_SERVING_HOSTS
DEFAULT_NAMESPACE = "istio-system"
DEFAULT_CLUSTER_ID = "Kubernetes"
IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
TokenValidation = Literal["tokenreview", "offline"]
TOKEN_VALIDATIONS: tuple[TokenValidation, ...] = ("tokenreview", "offline")
_DNS_LABEL = r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?"
_SERVING_HOST = re.compile(rf"(\*\.)?{_DNS_LABEL}(\.{_DNS_LABEL})*")
_REVISION = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # also a namespace name (DNS label)
# A signer name as certificates.k8s.io takes it: a DNS subdomain, '/', a path; not kubernetes.io.
_SIGNER_NAME = re.compile(
    r"(?!kubernetes\.io/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9][-A-Za-z0-9._~]{0,199}"
)
_MIN_ISTIOD_TLS_LIFETIME = timedelta(seconds=10)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# `--rpc-server`: which gRPC server runs the CA (`ca_server.serving.cq_server.rpc_server_for`).
RPC_SERVER_CHOICES = ("auto", "completion-queue", "aio")


class ConfigError(ValueError):
    """A flag or environment variable has a value the CA cannot use; the message names it."""


@dataclass(frozen=True)
class JwtIssuerConfig:
    """One trusted token issuer: its `iss`, where its keys are (file or URL), accepted audiences."""

    issuer: str
    jwks: str
    audiences: tuple[str, ...] = (DEFAULT_AUDIENCE,)


@dataclass(frozen=True)
class TtlPolicy:
    """Workload certificate lifetimes: requests are clamped into [minimum, maximum]."""

    default: timedelta = timedelta(hours=24)
    maximum: timedelta = timedelta(days=90)
    minimum: timedelta = timedelta(minutes=10)

    def __post_init__(self) -> None:
        if not timedelta(0) < self.minimum <= self.default <= self.maximum:
            raise ValueError(
                "workload certificate TTLs must satisfy 0 < minimum <= default <= maximum "
                f"(got minimum={self.minimum}, default={self.default}, maximum={self.maximum})"
            )


@dataclass(frozen=True)
class KubeConfig:
    """Kubernetes mode: where the API server is and what the CA does with it.

    `kubeconfig=None` means in-cluster credentials (the pod's service account). Remote clusters
    are only asked to review tokens whose request names them in the `clusterid` header.
    """

    kubeconfig: Path | None = None
    remote_kubeconfigs: tuple[tuple[str, Path], ...] = ()
    namespace: str = DEFAULT_NAMESPACE
    cluster_id: str = DEFAULT_CLUSTER_ID
    token_review: bool = True
    # How bearer tokens of this cluster are checked: a TokenReview per new token, or offline
    # against the issuer's JWKS and the pod informer (`ca_server.kube.bound_tokens`).
    token_validation: TokenValidation = "tokenreview"
    audiences: tuple[str, ...] = (DEFAULT_AUDIENCE,)
    trusted_node_accounts: tuple[tuple[str, str], ...] = ()
    # Names this replica in the leader Lease and in its API user agent.
    instance_id: str = "meshca"
    # TokenReview calls per second (sustained) and burst, per CA process; the pages of the
    # cluster-wide caches' lists are paced at the same rate, in a bucket of their own.
    qps: float = 50.0
    burst: int = 100
    # Objects per page of those lists: the transient memory of a list is one page's.
    list_page_size: int = 500
    # Stream those lists from the API server's watch cache (watch-list) rather than page them.
    stream_lists: bool = True
    # HTTP connections kept per API server: the long-lived watches plus concurrent reviews.
    connection_pool_size: int = 16
    publish_root: bool = True
    lease_duration: timedelta = timedelta(seconds=15)
    resync_interval: timedelta = timedelta(seconds=60)
    # istiod's serving certificate in Secret istiod-tls (`ca_server.kube.istiod_tls`): on unless
    # the mesh keeps no istiod; its namespace (None: the CA's), revisions and lifetime.
    istiod_tls: bool = True
    istiod_namespace: str | None = None
    istiod_revisions: tuple[str, ...] = ()
    istiod_tls_lifetime: timedelta = timedelta(hours=1)
    # Kubernetes-native identity (docs/pod-certificates.md): the signer name this CA answers
    # PodCertificateRequests for and publishes its roots under as ClusterTrustBundles; None: off.
    pod_certificate_signer: str | None = None
    # Also write Istio's own bundle `istio.io:istiod-ca:root-cert` (signer istio.io/istiod-ca),
    # so Istio's injection templates that project it work unchanged.
    istio_cluster_trust_bundle: bool = False


@dataclass(frozen=True)
class AdmissionPolicy:
    """How many CreateCertificate requests one CA process works on at once (see
    `ca_server.admission`). First certificates may use all `max_in_flight` slots; renewals
    (requests with `x-meshca-renewal: 1`) only the first `max_in_flight_renewals`, so under a
    storm renewals are refused first and pods waiting for their first certificate get through.
    Agent reports come last: admitted only while fewer than `reports_limit` requests of any
    kind are in flight, and never in a certificate request's slot."""

    max_in_flight: int = 128
    max_in_flight_renewals: int = 64
    # None: a quarter of `max_in_flight`, at most `max_in_flight_renewals` (`reports_limit`).
    max_in_flight_reports: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.max_in_flight_renewals <= self.max_in_flight:
            raise ValueError(
                "admission limits must satisfy 0 < renewals <= max in flight "
                f"(got renewals={self.max_in_flight_renewals}, max={self.max_in_flight})"
            )
        reports = self.max_in_flight_reports
        if reports is not None and not 0 < reports <= self.max_in_flight_renewals:
            raise ValueError(
                "admission limits must satisfy 0 < reports <= renewals "
                f"(got reports={reports}, renewals={self.max_in_flight_renewals})"
            )

    @property
    def reports_limit(self) -> int:
        """The in-flight level at which agent reports are refused."""
        if self.max_in_flight_reports is not None:
            return self.max_in_flight_reports
        return min(max(1, self.max_in_flight // 4), self.max_in_flight_renewals)


@dataclass(frozen=True)
class WorkerRole:
    """Set when this process is worker `slot` of a `meshca ca --workers N` supervisor: it
    shares the gRPC ports with its siblings (SO_REUSEPORT), leaves the monitoring port to the
    supervisor, and marks itself ready by creating `ready_file`."""

    slot: int
    ready_file: Path

    @property
    def status_file(self) -> Path:
        """Where this worker publishes its part of the supervisor's `/debug/ca`
        (`ca_server.serving.worker_status`): beside its ready file, in the supervisor's run
        directory."""
        return self.ready_file.with_name(f"debug-ca-{self.slot}.json")

    @property
    def cache_socket(self) -> Path:
        """Where the supervisor answers lookups in its cluster-wide caches
        (`ca_server.kube.cache_service`): in its run directory, beside the ready files."""
        return self.ready_file.with_name("kube-caches.sock")


@dataclass(frozen=True)
class JwtSvidConfig:
    """JWT-SVIDs (`ca_server.jwt_svid`): the key every CA process shares, the tokens' life, and
    the OIDC discovery endpoint (off unless `oidc_listen` is given)."""

    token_ttl: timedelta = timedelta(minutes=5)
    key_algorithm: str = "ES256"
    key_lifetime: timedelta = timedelta(days=1)
    jwks_max_age: timedelta = timedelta(minutes=5)
    # The activation gate: this share of the agents holding a JWT bundle must hold the new key.
    activate_at_coverage: float = 1.0
    oidc_listen: str | None = None
    oidc_issuer: str | None = None  # the tokens' `iss`; default http://<oidc_listen>

    @property
    def issuer(self) -> str | None:
        """The tokens' `iss` and the discovery document's `issuer` (None: no `iss`)."""
        if self.oidc_issuer:
            return self.oidc_issuer.rstrip("/")
        return f"http://{self.oidc_listen}" if self.oidc_listen else None


@dataclass(frozen=True)
class CaConfig:
    data_dir: Path
    listen: str = "127.0.0.1:15012"
    mtls_listen: str | None = None
    monitoring_listen: str = "127.0.0.1:15014"
    # `/debug/ca` (identities and serials) and `/metrics` for `meshca status`; off when None.
    debug_listen: str | None = None
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    cacerts_dir: Path | None = None
    jwt_issuers: tuple[JwtIssuerConfig, ...] = ()
    trust_dev_issuer: bool = True
    ttl: TtlPolicy = field(default_factory=TtlPolicy)
    root_key: KeySpec = field(default_factory=KeySpec)
    root_lifetime: timedelta = timedelta(days=3650)
    # Self-signed rotation (see `ca_server.authority.slots`): prepare the next authority when
    # half the active one's life is left but at most `root_prepare_cap` before its expiry;
    # activate when a sixth is left but at most `root_activate_cap` before.
    root_rotation: bool = True
    root_prepare_cap: timedelta = timedelta(days=180)
    root_activate_cap: timedelta = timedelta(days=90)
    # The activation gate (see `ca_server.authority.slots.SlotRotationPolicy`): None activates
    # by the clock.
    activate_at_coverage: float | None = None
    activate_deadline: float = 0.5
    serving_hosts: tuple[str, ...] = DEFAULT_SERVING_HOSTS
    serving_cert_lifetime: timedelta = timedelta(days=365)
    plugged_ca_poll_interval: timedelta = timedelta(seconds=5)
    shutdown_grace: timedelta = timedelta(seconds=2)
    kube: KubeConfig | None = None
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    cpu_scheduling: str = "batch"  # `ca_server.serving.cpu_scheduling`
    rpc_server: str = "auto"  # RPC_SERVER_CHOICES, `ca_server.serving.cq_server`
    worker: WorkerRole | None = None
    jwt: JwtSvidConfig = field(default_factory=JwtSvidConfig)

    def listen_addresses(self) -> list[tuple[str, str]]:
        """(flag, address) of every port this CA listens on."""
        addresses = {
            "--listen": self.listen,
            "--mtls-listen": self.mtls_listen,
            "--monitoring-listen": self.monitoring_listen,
            "--debug-listen": self.debug_listen,
            "--oidc-listen": self.jwt.oidc_listen,
        }
        return [(flag, address) for flag, address in addresses.items() if address is not None]

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> CaConfig:
        """Merges parsed flags (from `ca_server.flags.add_ca_arguments`) over `environ` over
        defaults; `ConfigError` names the flag to fix."""
        if len(args.jwks) != len(args.jwt_issuer):
            raise ConfigError("give one --jwt-issuer for each --jwks")
        audiences = tuple(args.audience) or (DEFAULT_AUDIENCE,)
        issuers = tuple(
            JwtIssuerConfig(issuer, jwks, audiences)
            for issuer, jwks in zip(args.jwt_issuer, args.jwks, strict=True)
        )
        kube = _kube_config(args, environ)
        worker = _worker_role(args)
        if kube is not None and worker is not None:
            # Each worker is a replica: it needs its own name in the leader Lease.
            kube = replace(kube, instance_id=f"{kube.instance_id}-w{worker.slot}")
        # The development issuer is a local stand-in for the API server: never trusted by
        # default when a real cluster (or real issuer) is configured.
        trust_dev = args.dev_issuer if args.dev_issuer is not None else not (issuers or kube)
        try:
            ttl = TtlPolicy(
                args.workload_cert_ttl, args.max_workload_cert_ttl, args.min_workload_cert_ttl
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        config = cls(
            data_dir=args.data_dir,
            listen=args.listen,
            mtls_listen=args.mtls_listen,
            monitoring_listen=args.monitoring_listen,
            debug_listen=args.debug_listen,
            trust_domain=args.trust_domain,
            cacerts_dir=args.cacerts_dir,
            jwt_issuers=issuers,
            trust_dev_issuer=trust_dev,
            ttl=ttl,
            root_key=args.root_key,
            root_lifetime=args.root_ttl,
            root_rotation=args.root_rotation,
            root_prepare_cap=args.root_prepare_cap,
            root_activate_cap=args.root_activate_cap,
            activate_at_coverage=args.activate_at_coverage,
            activate_deadline=args.activate_deadline,
            plugged_ca_poll_interval=args.ca_reload_interval,
            kube=kube,
            admission=_admission(args),
            cpu_scheduling=args.cpu_scheduling,
            rpc_server=args.rpc_server,
            worker=worker,
            jwt=_jwt_svid(args),
        )
        if args.serving_host:
            config = replace(config, serving_hosts=tuple(args.serving_host))
        _check_addresses(config)
        _check_names(config)
        if config.data_dir.exists() and not config.data_dir.is_dir():
            raise ConfigError(f"--data-dir {config.data_dir}: is not a directory; give a directory")
        if config.plugged_ca_poll_interval <= timedelta(0):
            raise ConfigError("--ca-reload-interval must be positive, e.g. 5s")
        if config.root_lifetime <= timedelta(0):
            raise ConfigError(
                f"--root-ttl {format_duration(config.root_lifetime)}: an authority must live "
                "longer than that; give e.g. 3650d (or 1h to try rotation)"
            )
        if config.activate_at_coverage is not None and not 0 < config.activate_at_coverage <= 1:
            raise ConfigError(
                f"--activate-at-coverage {config.activate_at_coverage} must be a fraction in "
                "(0, 1], e.g. 0.95 for 95% of the reporting agents"
            )
        if not 0 <= config.activate_deadline < 1:
            raise ConfigError(
                f"--activate-deadline {config.activate_deadline} must be in [0, 1): the share of "
                "the activation lead the gate may wait (0.5: half)"
            )
        if config.activate_at_coverage is not None and not config.root_rotation:
            raise ConfigError(
                "--activate-at-coverage gates the automatic activation: it needs --root-rotation"
            )
        if config.root_activate_cap >= config.root_prepare_cap:
            raise ConfigError(
                "--root-activate-cap must be shorter than --root-prepare-cap (got "
                f"{format_duration(config.root_activate_cap)} and "
                f"{format_duration(config.root_prepare_cap)})"
            )
        return config


def _jwt_svid(args: argparse.Namespace) -> JwtSvidConfig:
    """The JWT-SVID flags, checked: the key must outlive six tokens (a rotation's lead)."""
    jwt = JwtSvidConfig(
        token_ttl=args.jwt_svid_ttl,
        key_algorithm=args.jwt_key_algorithm,
        key_lifetime=args.jwt_key_ttl,
        jwks_max_age=args.jwks_max_age,
        activate_at_coverage=args.jwt_activate_at_coverage,
        oidc_listen=args.oidc_listen or None,  # "": a worker (its supervisor serves discovery)
        oidc_issuer=args.oidc_issuer or None,
    )
    if not 0 < jwt.activate_at_coverage <= 1:
        raise ConfigError(
            f"--jwt-activate-at-coverage {jwt.activate_at_coverage} must be a fraction in (0, 1]"
        )
    if jwt.token_ttl < timedelta(seconds=30):
        raise ConfigError("--jwt-svid-ttl must be at least 30s, e.g. 5m")
    if jwt.key_lifetime <= 6 * jwt.token_ttl:
        raise ConfigError(
            f"--jwt-key-ttl {format_duration(jwt.key_lifetime)} must be more than six times "
            f"--jwt-svid-ttl {format_duration(jwt.token_ttl)}: a token signed just before a "
            "rotation must fit in its key's remaining life"
        )
    return jwt


def _check_addresses(config: CaConfig) -> None:
    """Each address flag is HOST:PORT, and no two of them name the same port."""
    seen: dict[tuple[str, int], str] = {}
    for flag, address in config.listen_addresses():
        try:
            host, port = parse_listen(flag, address)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if port and (host, port) in seen:
            raise ConfigError(
                f"{flag} {address}: {seen[host, port]} already uses that port; give each its own"
            )
        seen[host, port] = flag


def _check_names(config: CaConfig) -> None:
    try:
        SpiffeId(config.trust_domain, "ns", "sa")
    except SpiffeIdError as exc:
        raise ConfigError(f"--trust-domain: {exc}") from None
    for host in config.serving_hosts:
        if not _SERVING_HOST.fullmatch(host):
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ConfigError(
                    f"--serving-host {host!r}: give a DNS name (e.g. meshca.istio-system.svc) or "
                    "an IP address"
                ) from None


def _admission(args: argparse.Namespace) -> AdmissionPolicy:
    """The limits as given; a renewals or reports level above the one it must stay under is
    refused (cutting it silently would leave the operator believing in a limit that is not)."""
    if args.max_in_flight_renewals is not None and args.max_in_flight_renewals > args.max_in_flight:
        raise ConfigError(
            f"--max-in-flight-renewals {args.max_in_flight_renewals} is above --max-in-flight "
            f"{args.max_in_flight}: renewals are refused at a level within it; lower it or raise "
            "--max-in-flight"
        )
    renewals = args.max_in_flight_renewals or max(1, args.max_in_flight // 2)
    reports = args.max_in_flight_reports
    if reports is not None and reports > renewals:
        given = (
            "--max-in-flight-renewals"
            if args.max_in_flight_renewals
            else "its default, half of --max-in-flight"
        )
        raise ConfigError(
            f"--max-in-flight-reports {reports} is above the renewals' level {renewals} "
            f"({given}): reports are refused before renewals; lower it or raise "
            "--max-in-flight-renewals"
        )
    try:
        return AdmissionPolicy(args.max_in_flight, renewals, reports)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _worker_role(args: argparse.Namespace) -> WorkerRole | None:
    if args.worker_slot is None or args.worker_ready_file is None:
        return None
    return WorkerRole(args.worker_slot, args.worker_ready_file)


def _kube_config(args: argparse.Namespace, environ: Mapping[str, str]) -> KubeConfig | None:
    """Kubernetes mode is on with `--kubeconfig`, or in a pod (in-cluster credentials), unless
    `--no-kubernetes`; `--kubernetes` insists (and fails at start-up without credentials)."""
    in_cluster = bool(environ.get("KUBERNETES_SERVICE_HOST")) and IN_CLUSTER_TOKEN.exists()
    enabled = args.kubernetes
    if enabled is None:
        enabled = args.kubeconfig is not None or in_cluster
    if not enabled:
        return None
    remote = []
    for item in args.remote_kubeconfig:
        cluster_id, sep, path = item.partition("=")
        if not sep or not cluster_id or not path:
            raise ConfigError(f"--remote-kubeconfig {item!r} is not CLUSTER_ID=PATH")
        remote.append((cluster_id, Path(path)))
    accounts = args.trusted_node_accounts
    if accounts is None:
        accounts = environ.get("CA_TRUSTED_NODE_ACCOUNTS", "")
    try:
        trusted = parse_account_list(accounts)
    except ValueError as exc:
        raise ConfigError(f"--trusted-node-accounts: {exc}") from exc
    revisions = tuple(r for r in args.istiod_revisions.split(",") if r)
    for revision in revisions:
        if not _REVISION.fullmatch(revision):
            raise ConfigError(
                f"--istiod-revisions: {revision!r} is not a revision name (lower-case letters, "
                "digits and '-', as in istiod-<revision>)"
            )
    if args.istiod_namespace is not None and not _REVISION.fullmatch(args.istiod_namespace):
        raise ConfigError(f"--istiod-namespace: {args.istiod_namespace!r} is not a namespace name")
    if args.istiod_tls_lifetime < _MIN_ISTIOD_TLS_LIFETIME:
        raise ConfigError(
            f"--istiod-tls-lifetime {format_duration(args.istiod_tls_lifetime)} is too short: "
            f"at least {format_duration(_MIN_ISTIOD_TLS_LIFETIME)} (istiod's certificate is "
            "re-issued at 40% of it)"
        )
    signer = args.pod_certificate_signer or None
    if signer is not None and not _SIGNER_NAME.fullmatch(signer):
        raise ConfigError(
            f"--pod-certificate-signer: {signer!r} is not a signer name: a DNS domain you own, "
            "'/', then a path (e.g. meshca.example.com/spiffe); kubernetes.io/ names are "
            "reserved for Kubernetes' own signers"
        )
    instance_id = (
        args.instance_id or environ.get("POD_NAME") or (f"{socket.gethostname()}-{os.getpid()}")
    )
    return KubeConfig(
        kubeconfig=args.kubeconfig,
        remote_kubeconfigs=tuple(remote),
        namespace=args.namespace or environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
        cluster_id=args.cluster_id or environ.get("CLUSTER_ID") or DEFAULT_CLUSTER_ID,
        token_review=args.token_review,
        token_validation=args.token_validation,
        audiences=tuple(args.audience) or (DEFAULT_AUDIENCE,),
        trusted_node_accounts=trusted,
        instance_id=instance_id,
        qps=args.kube_qps,
        burst=args.kube_burst,
        list_page_size=args.kube_list_page_size,
        stream_lists=args.kube_stream_lists,
        publish_root=args.root_configmaps,
        istiod_tls=args.istiod_tls,
        istiod_namespace=args.istiod_namespace,
        istiod_revisions=revisions,
        istiod_tls_lifetime=args.istiod_tls_lifetime,
        pod_certificate_signer=signer,
        istio_cluster_trust_bundle=args.istio_cluster_trust_bundle,
    )


# --- flags ------------------------------------------------------------------------------------
