"""The CA's configuration: one typed object built once from flags, then passed down.

`add_ca_arguments` registers `meshca ca`'s flags; `CaConfig.from_args(args, environ)` merges them
over Istio's environment variables (`POD_NAMESPACE`, `CLUSTER_ID`, `CA_TRUSTED_NODE_ACCOUNTS`,
`POD_NAME`, `KUBERNETES_SERVICE_HOST`) and the defaults. The environment is handed in, so nothing
below reads `os.environ` and tests can pass a dict — the same shape as `agent.config`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Literal

from ca_server.serving.cpu_scheduling import CPU_SCHEDULING_CHOICES
from ca_server.wire import CA_SERVING_HOSTS, RENEWAL_HEADER, REPORT_SERVICE, RETRY_PUSHBACK_TRAILER
from certs import DEFAULT_TRUST_DOMAIN, CertsError, KeySpec, SpiffeId, format_duration
from certs.errors import SpiffeIdError
from meshca.accounts import parse_account_list
from meshca.durations import parse_duration
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
    # TokenReview calls per second (sustained) and burst, per CA process.
    qps: float = 50.0
    burst: int = 100
    # HTTP connections kept per API server: the long-lived watches plus concurrent reviews.
    connection_pool_size: int = 16
    publish_root: bool = True
    lease_duration: timedelta = timedelta(seconds=15)
    resync_interval: timedelta = timedelta(seconds=60)


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

    def listen_addresses(self) -> list[tuple[str, str]]:
        """(flag, address) of every port this CA listens on."""
        addresses = {
            "--listen": self.listen,
            "--mtls-listen": self.mtls_listen,
            "--monitoring-listen": self.monitoring_listen,
            "--debug-listen": self.debug_listen,
        }
        return [(flag, address) for flag, address in addresses.items() if address is not None]

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> CaConfig:
        """Merges parsed flags (from `add_ca_arguments`) over `environ` over defaults;
        `ConfigError` names the flag to fix."""
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
        publish_root=args.root_configmaps,
    )


# --- flags ------------------------------------------------------------------------------------


def duration_argument(text: str) -> timedelta:
    """An argparse type for durations such as `90d`, `24h`, `10m`."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def log_level_argument(text: str) -> str:
    """An argparse type: one of Python's logging level names, any case."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        choices = ", ".join(LOG_LEVELS)
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level; use {choices}")
    return level


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` that must be above zero."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be greater than 0")
        return value

    return parse


def _key_spec(text: str) -> KeySpec:
    try:
        return KeySpec.parse(text)
    except CertsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_ca_arguments(ca: argparse.ArgumentParser) -> None:
    """Registers `meshca ca`'s flags. Defaults that Istio's environment variables may fill in
    are None here; `CaConfig.from_args` resolves them from the environment it is handed."""
    ca.add_argument(
        "--data-dir",
        type=Path,
        required=True,
        help="state directory: root key/cert, dev issuer, published root-cert.pem",
    )
    ca.add_argument("--listen", default="127.0.0.1:15012", help="gRPC TLS address")
    ca.add_argument(
        "--mtls-listen",
        default=None,
        help="extra gRPC address that requires a client certificate (renewal over mTLS)",
    )
    ca.add_argument(
        "--monitoring-listen",
        default="127.0.0.1:15014",
        help="HTTP address for /metrics, /healthz, /ready (no identities: see --debug-listen)",
    )
    ca.add_argument(
        "--debug-listen",
        default=None,
        metavar="HOST:PORT",
        help="HTTP address for /debug/ca (identities, serials, authorities) and /metrics, what "
        "`meshca status` reads of a CA; off unless given; keep it on loopback (127.0.0.1:15015)",
    )
    ca.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN)
    ca.add_argument(
        "--cacerts-dir",
        type=Path,
        default=None,
        help="plugged-in CA directory (Istio cacerts layout or tls.crt/tls.key/ca.crt)",
    )
    ca.add_argument(
        "--jwks",
        action="append",
        default=[],
        help="JWKS file or URL of a trusted token issuer (repeat with --jwt-issuer)",
    )
    ca.add_argument(
        "--jwt-issuer",
        action="append",
        default=[],
        help="the `iss` of the issuer whose keys the matching --jwks holds",
    )
    ca.add_argument(
        "--audience",
        action="append",
        default=[],
        help=f"accepted token audience (default {DEFAULT_AUDIENCE})",
    )
    ca.add_argument(
        "--dev-issuer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trust the development issuer in --data-dir (default: only if no --jwks)",
    )
    ca.add_argument("--workload-cert-ttl", type=duration_argument, default="24h")
    ca.add_argument("--max-workload-cert-ttl", type=duration_argument, default="90d")
    ca.add_argument("--min-workload-cert-ttl", type=duration_argument, default="10m")
    ca.add_argument(
        "--root-key",
        type=_key_spec,
        default=KeySpec(),
        help="key type of a generated root: ec-p256 (default), ec-p384, rsa-2048...",
    )
    ca.add_argument(
        "--root-ttl",
        type=duration_argument,
        default="3650d",
        help="lifetime of each self-signed authority (down to seconds, for trying rotation)",
    )
    ca.add_argument(
        "--root-rotation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rotate the self-signed authority by itself (prepare at 1/2 of its life, "
        "activate at 5/6); off: only `meshca authority` changes it",
    )
    ca.add_argument(
        "--root-prepare-cap",
        type=duration_argument,
        default="180d",
        help="prepare the next authority at most this long before the active one expires",
    )
    ca.add_argument(
        "--root-activate-cap",
        type=duration_argument,
        default="90d",
        help="activate it at most this long before the active one expires; also the longest "
        "workload certificate the CA signs, so a rotation never cuts one short",
    )
    ca.add_argument(
        "--activate-at-coverage",
        type=float,
        default=None,
        metavar="F",
        help="self-signed rotation: at the 5/6 point, activate the prepared authority only once "
        "this fraction of the reporting agents trust it (e.g. 0.95); default: by the clock. "
        "Plugged-in CA: take a change that moves signing to another root only once this "
        "fraction of the reporting agents trust that root",
    )
    ca.add_argument(
        "--activate-deadline",
        type=float,
        default=0.5,
        metavar="SHARE",
        help="with --activate-at-coverage: activate anyway (with a WARNING) once this share of "
        "the time between the 5/6 point and the active authority's expiry has passed; leaves "
        "signed meanwhile get at least (1 - SHARE) of the maximum TTL. Plugged-in CA: take a "
        "held-back change to another root anyway (with a WARNING) once this share of the "
        "current signing certificate's remaining life has passed since it was first held [0.5]",
    )
    ca.add_argument(
        "--ca-reload-interval",
        "--authority-poll-interval",
        dest="ca_reload_interval",
        type=duration_argument,
        default="5s",
        help="how often to check the plugged-in CA files or the shared root Secret for changes",
    )
    ca.add_argument(
        "--serving-host",
        action="append",
        default=[],
        help="DNS name or IP for the CA's TLS certificate (repeatable)",
    )
    _add_kubernetes_flags(ca)
    _add_capacity_flags(ca)
    ca.add_argument(
        "--log-level", type=log_level_argument, default="INFO", help="DEBUG, INFO, WARNING, ERROR"
    )


def _add_capacity_flags(ca: argparse.ArgumentParser) -> None:
    capacity = ca.add_argument_group(
        "capacity", "worker processes and admission control (docs/performance.md)"
    )
    capacity.add_argument(
        "--workers",
        type=_positive(int),
        default=None,
        help="CA processes serving the same ports (SO_REUSEPORT) under one supervisor; "
        "default: the CPUs available to meshca (within its CPU quota). 1 runs a single process",
    )
    capacity.add_argument(
        "--max-in-flight",
        type=_positive(int),
        default=AdmissionPolicy.max_in_flight,
        help="requests one worker works on at once; beyond it, UNAVAILABLE with a "
        f"{RETRY_PUSHBACK_TRAILER} hint (default %(default)s)",
    )
    capacity.add_argument(
        "--max-in-flight-renewals",
        type=_positive(int),
        default=None,
        help=f"in-flight level at which renewals ({RENEWAL_HEADER}: 1) are refused "
        "(default: half of --max-in-flight), so first certificates get through first",
    )
    capacity.add_argument(
        "--max-in-flight-reports",
        type=_positive(int),
        default=None,
        help=f"in-flight level at which agent reports ({REPORT_SERVICE}) are "
        "refused (default: a quarter of --max-in-flight, at most the renewals' level); "
        "reports never take a certificate request's slot",
    )
    capacity.add_argument(
        "--cpu-scheduling",
        choices=CPU_SCHEDULING_CHOICES,
        default="batch",
        help="Linux scheduling policy of the CA's threads: batch (SCHED_BATCH: a woken gRPC "
        "thread does not preempt the one signing; same CPU share) or normal "
        "(default %(default)s; docs/performance.md)",
    )
    capacity.add_argument(
        "--rpc-server",
        choices=RPC_SERVER_CHOICES,
        default="auto",
        help="gRPC server: completion-queue (one thread polls grpcio's completion queue and "
        "answers inline; about 4x less CPU per call; the CA refuses to start when the "
        "installed grpcio cannot run it), aio (grpc.aio's server), or auto: the first when the "
        "installed grpcio is a tested release, else the second with a warning "
        "(default %(default)s; docs/performance.md)",
    )
    # Set by the supervisor for its workers only.
    capacity.add_argument("--worker-slot", type=int, default=None, help=argparse.SUPPRESS)
    capacity.add_argument("--worker-ready-file", type=Path, default=None, help=argparse.SUPPRESS)


def _add_kubernetes_flags(ca: argparse.ArgumentParser) -> None:
    kube = ca.add_argument_group(
        "Kubernetes mode",
        "on with --kubeconfig, or automatically with in-cluster credentials: TokenReview "
        "authentication, shared root in Secret istio-ca-secret, root ConfigMaps, node authorizer",
    )
    kube.add_argument(
        "--kubernetes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force Kubernetes mode on/off (default: on with --kubeconfig or in a pod)",
    )
    kube.add_argument("--kubeconfig", type=Path, default=None, help="kubeconfig of this cluster")
    kube.add_argument(
        "--remote-kubeconfig",
        action="append",
        default=[],
        metavar="CLUSTER_ID=PATH",
        help="kubeconfig of a remote cluster whose tokens arrive with `clusterid: CLUSTER_ID`",
    )
    kube.add_argument(
        "--namespace",
        default=None,
        help="the CA's own namespace (Secret, Lease); default $POD_NAMESPACE or istio-system",
    )
    kube.add_argument(
        "--cluster-id",
        default=None,
        help="this cluster's id, as sent in the clusterid header (default $CLUSTER_ID)",
    )
    kube.add_argument(
        "--trusted-node-accounts",
        default=None,
        metavar="NS/SA,...",
        help="service accounts allowed to impersonate pods on their node (ztunnel); "
        "default $CA_TRUSTED_NODE_ACCOUNTS",
    )
    kube.add_argument(
        "--token-review",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="authenticate bearer tokens with TokenReview (Kubernetes mode only)",
    )
    kube.add_argument(
        "--token-validation",
        choices=TOKEN_VALIDATIONS,
        default="tokenreview",
        help="check this cluster's tokens with a TokenReview per new token, or offline against "
        "the issuer's keys and the pod informer (pod-bound tokens only; see docs/kubernetes.md)",
    )
    kube.add_argument(
        "--root-configmaps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish ConfigMap istio-ca-root-cert in every namespace (Kubernetes mode only)",
    )
    kube.add_argument(
        "--instance-id",
        default=None,
        help="this replica's name in the leader Lease and API user agent (default $POD_NAME)",
    )
    kube.add_argument(
        "--kube-qps", type=_positive(float), default=50.0, help="TokenReview calls/second"
    )
    kube.add_argument("--kube-burst", type=_positive(int), default=100, help="TokenReview burst")
