"""The agent's configuration: one frozen object, built once at start-up, then passed down.

Sources, highest precedence first: command-line flags, Istio's environment variables
(docs/reference.md#agent-environment, same names and defaults, so an Istio sidecar's env works
unchanged), built-in defaults.
Nothing below this module reads `os.environ`; `from_args` receives the environment explicitly so
tests can hand in a dict.

**meshca:** the default workload key is ECDSA P-256 (Istio's is RSA-2048). Istio's variables
still select the other kinds: `ECC_SIGNATURE_ALGORITHM=ECDSA` with `ECC_CURVE`, or
`ECC_SIGNATURE_ALGORITHM=RSA` / an explicit `WORKLOAD_RSA_KEY_SIZE` for RSA.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from certs import DEFAULT_TRUST_DOMAIN, KeySpec, SpiffeId
from meshca.accounts import parse_account_list
from meshca.durations import parse_duration
from meshca.host_port import join_host_port
from meshca.listen import parse_listen
from meshca.wire import CA_TLS_NAME, MAX_REPORT_INTERVAL

DEFAULT_CA_ADDR = f"{CA_TLS_NAME}:15012"
DEFAULT_CA_ROOT_CA = "./var/run/secrets/istio/root-cert.pem"
DEFAULT_TOKEN_PATH = "./var/run/secrets/tokens/istio-token"
DEFAULT_SDS_SOCKET = "./var/run/secrets/workload-spiffe-uds/socket"
DEFAULT_FILE_MOUNTED_DIR = "./etc/certs"
# The variable SPIFFE clients read; the agent reads the same one, so one value in a pod spec
# names the socket for both sides of the shared volume (docs/workload-api.md).
WORKLOAD_API_SOCKET_ENV = "SPIFFE_ENDPOINT_SOCKET"
DEFAULT_STATUS_LISTEN = "127.0.0.1:15020"
DEFAULT_MAX_CONCURRENT_FETCHES = 8  # ztunnel's limit
# Where Istio's conventions mount certificates for file-cert:/file-root: (user certificates,
# gateway certificates, Kubernetes-projected volumes). See docs/agent.md.
DEFAULT_FILE_SECRET_DIRS = "/etc/certs:/etc/istio:/var/run/secrets"
SYSTEM_ROOTS = "SYSTEM"
# Two minutes: a fleet of 10 000 agents sends ~80 light reports/s, and a new root's coverage or a
# taint is known within two minutes. Bounded so a typo cannot flood the CA or starve it, and
# at most ten minutes (`meshca.wire`): the CA expires a report a few intervals later.
DEFAULT_REPORT_INTERVAL = timedelta(minutes=2)
MIN_REPORT_INTERVAL = timedelta(seconds=1)
# Five minutes: 10 000 identities re-signing after a taint arrive at ~33 CSRs/s, well within
# one CA replica's rate, while a compromised authority's leaves are gone within minutes.
DEFAULT_TAINT_RESIGN_WINDOW = timedelta(minutes=5)
CA_HEADER_PREFIX = "CA_HEADER_"
# sun_path is 108 bytes with its NUL; `agent.unix_socket` binds at a name of
# `SOCKET_BIND_NAME_BYTES` beside the path before renaming it there, so both must fit.
MAX_SOCKET_PATH_BYTES = 107
SOCKET_BIND_NAME_BYTES = 8
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A flag or environment variable has a value the agent cannot use; the message names it."""


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs to know, typed and validated.

    `namespace`/`service_account` may be None: the agent then reads them from the token's claims
    (see `agent.token.identity_from_token`).
    """

    ca_addr: str = DEFAULT_CA_ADDR
    # None means "verify the CA with the operating system's roots" (CA_ROOT_CA=SYSTEM).
    ca_root_ca: Path | None = Path(DEFAULT_CA_ROOT_CA)
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    namespace: str | None = None
    service_account: str | None = None
    secret_ttl: timedelta = timedelta(hours=24)
    grace_period_ratio: float = 0.5
    grace_period_ratio_jitter: float = 0.01
    key_spec: KeySpec = field(default_factory=KeySpec)
    output_certs: Path | None = None
    file_mounted_certs: bool = False
    file_mounted_dir: Path = Path(DEFAULT_FILE_MOUNTED_DIR)
    # FILE_MOUNTED_CERTS from the kubelet's `podCertificate` credential bundle (key, then chain)
    # instead of cert-chain.pem + key.pem; the root stays `file_mounted_dir`/root-cert.pem.
    credential_bundle: Path | None = None
    prov_cert: Path | None = None
    cluster_id: str = ""
    ca_headers: tuple[tuple[str, str], ...] = ()
    token_path: Path = Path(DEFAULT_TOKEN_PATH)
    sds_socket: Path = Path(DEFAULT_SDS_SOCKET)
    sds_socket_mode: int = 0o600
    # The SPIFFE Workload API (agent.workload.api): off unless a socket is configured.
    workload_api_socket: Path | None = None
    workload_api_socket_mode: int = 0o600
    status_host: str = "127.0.0.1"
    status_port: int = 15020
    ca_request_timeout: timedelta = timedelta(seconds=10)
    # How often the root file (ca_root_ca) is stat'ed for a new trust bundle (agent.polled_file).
    root_file_poll_interval: timedelta = timedelta(seconds=1)
    log_level: str = "INFO"
    # Node mode (ztunnel's pattern): one agent, one certificate per identity on its node.
    node_mode: bool = False
    node_name: str | None = None
    # POD_NAME (Istio's downward-API variable): names this agent in `x-meshca-agent-id`.
    pod_name: str | None = None
    kubeconfig: Path | None = None
    # True when running in a pod (KUBERNETES_SERVICE_HOST set): in-cluster API credentials.
    in_cluster: bool = False
    identities: tuple[tuple[str, str], ...] = ()  # static (namespace, service account) pairs
    identities_file: Path | None = None
    max_concurrent_fetches: int = DEFAULT_MAX_CONCURRENT_FETCHES
    # The periodic report to a meshca CA (agent.reporter); zero turns it off.
    report_interval: timedelta = DEFAULT_REPORT_INTERVAL
    # Leaves of a tainted authority are re-signed at a uniform point this long after the taint.
    taint_resign_window: timedelta = DEFAULT_TAINT_RESIGN_WINDOW
    # Directories file-cert:/file-root: SDS names may read from (FILE_SECRET_DIRS).
    file_secret_dirs: tuple[Path, ...] = tuple(Path(d) for d in DEFAULT_FILE_SECRET_DIRS.split(":"))

    def __post_init__(self) -> None:
        if not 0 < self.grace_period_ratio < 1:
            raise ConfigError(
                f"SECRET_GRACE_PERIOD_RATIO={self.grace_period_ratio} must be between 0 and 1"
            )
        if (
            not 0
            <= self.grace_period_ratio_jitter
            < min(self.grace_period_ratio, 1 - self.grace_period_ratio)
        ):
            raise ConfigError(
                f"SECRET_GRACE_PERIOD_RATIO_JITTER={self.grace_period_ratio_jitter} must be "
                "non-negative and keep the ratio inside (0, 1)"
            )
        if socket_path_bytes(self.sds_socket) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(
                f"--sds-socket {str(self.sds_socket)[:40]}...: longer than "
                f"{MAX_SOCKET_PATH_BYTES} bytes, the Unix socket limit; choose a shorter path"
            )
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                f"--log-level {self.log_level!r} is not a log level; use {', '.join(LOG_LEVELS)}"
            )
        if self.secret_ttl <= timedelta(0):
            raise ConfigError("SECRET_TTL must be positive, e.g. 24h")
        if self.ca_request_timeout <= timedelta(0):
            raise ConfigError("--ca-request-timeout must be positive")
        if self.root_file_poll_interval <= timedelta(0):
            raise ConfigError("--root-file-poll-interval must be positive, e.g. 1s")
        if self.max_concurrent_fetches < 1:
            raise ConfigError("--max-concurrent-fetches must be at least 1")
        if self.report_interval and not (
            MIN_REPORT_INTERVAL <= self.report_interval <= MAX_REPORT_INTERVAL
        ):
            raise ConfigError(
                f"--report-interval {self.report_interval} must be between "
                f"{MIN_REPORT_INTERVAL} and {MAX_REPORT_INTERVAL} (or 0 to turn reports off)"
            )
        if self.taint_resign_window < timedelta(0):
            raise ConfigError("--taint-resign-window must not be negative (0: re-sign at once)")
        if self.credential_bundle is not None and not self.file_mounted_certs:
            raise ConfigError(
                f"--credential-bundle {self.credential_bundle} is read in file-mounted mode only: "
                "also set FILE_MOUNTED_CERTS=true (--file-mounted-certs); with a CA the agent "
                "makes its own key and asks for the certificate"
            )
        if self.node_mode:
            self._check_node_mode()
        if self.workload_api_socket is not None:
            self._check_workload_api()

    def _check_workload_api(self) -> None:
        if self.workload_api_socket == self.sds_socket:
            raise ConfigError(
                f"--workload-api-socket {self.workload_api_socket} is the SDS socket; give the "
                "Workload API a socket of its own (e.g. /run/spiffe/workload-api/socket)"
            )
        if self.node_mode and self.static_identities:
            raise ConfigError(
                "--workload-api-socket in node mode attests each caller by its pod, so it needs "
                "the pod watch (--kubeconfig, or in-cluster credentials); a static --identities "
                "list cannot tell callers apart"
            )

    def _check_node_mode(self) -> None:
        if self.file_mounted_certs:
            raise ConfigError(
                "--node-mode and FILE_MOUNTED_CERTS exclude each other: node mode asks the CA "
                "for every identity on the node"
            )
        if self.static_identities:
            return
        if self.kubeconfig is None and not self.in_cluster:
            raise ConfigError(
                "--node-mode needs an identity source: --kubeconfig PATH (or run in a pod for "
                "in-cluster credentials) to watch the node's pods, or a static list with "
                "--identities ns/sa,... or --identities-file PATH"
            )
        if not self.node_name:
            raise ConfigError(
                "--node-mode watching pods needs the node's name: --node-name or NODE_NAME "
                "(from the downward API, spec.nodeName)"
            )

    @property
    def static_identities(self) -> bool:
        """Node mode serves a fixed list instead of watching pods."""
        return bool(self.identities) or self.identities_file is not None

    @property
    def identity(self) -> SpiffeId | None:
        """The identity asked for, when both halves were configured."""
        if self.namespace and self.service_account:
            return SpiffeId(self.trust_domain, self.namespace, self.service_account)
        return None

    @property
    def status_listen(self) -> str:
        return join_host_port(self.status_host, self.status_port)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> AgentConfig:
        """Merges parsed flags (from `add_agent_arguments`) over `environ` over defaults."""
        return _build(args, environ)


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the agent's flags. Every default is None so `from_args` can tell "not given"
    from "given", letting the environment variable fill in."""
    add = parser.add_argument
    add("--ca-addr", help=f"CA endpoint host:port [CA_ADDR; {DEFAULT_CA_ADDR}]")
    add(
        "--ca-root",
        "--ca-root-ca",
        dest="ca_root_ca",
        help=f"root to verify the CA, or SYSTEM [CA_ROOT_CA; {DEFAULT_CA_ROOT_CA}]",
    )
    add("--trust-domain", help=f"[TRUST_DOMAIN; {DEFAULT_TRUST_DOMAIN}]")
    add("--namespace", help="identity's namespace [POD_NAMESPACE; else from the token]")
    add("--service-account", help="identity's service account [SERVICE_ACCOUNT; else token]")
    add("--secret-ttl", help="certificate lifetime to ask for [SECRET_TTL; 24h]")
    add("--grace-period-ratio", type=float, help="[SECRET_GRACE_PERIOD_RATIO; 0.5]")
    add("--grace-period-ratio-jitter", type=float, help="[SECRET_GRACE_PERIOD_RATIO_JITTER; 0.01]")
    add("--key-type", help="ec-p256, ec-p384, rsa-2048/3072/4096 [ECC_*/WORKLOAD_RSA_KEY_SIZE]")
    add(
        "--output-dir",
        "--output-certs",
        dest="output_certs",
        help="directory to write cert-chain.pem, key.pem, root-cert.pem",
    )
    add("--file-mounted-certs", action="store_true", default=None, help="[FILE_MOUNTED_CERTS]")
    add("--prov-cert", help="directory with cert-chain.pem/key.pem for mTLS to the CA")
    add("--cluster-id", help="sent as the clusterid header [ISTIO_META_CLUSTER_ID]")
    add(
        "--token-file",
        "--token-path",
        dest="token_path",
        help=f"service-account token file [{DEFAULT_TOKEN_PATH}]",
    )
    add("--sds-socket", help=f"SDS Unix socket path [{DEFAULT_SDS_SOCKET}]")
    add(
        "--sds-socket-mode",
        help="permissions of the SDS socket, octal [0600; 0660 lets the proxy's group connect]",
    )
    add(
        "--workload-api-socket",
        help="serve the SPIFFE Workload API on this Unix socket (unix:PATH or PATH); off unless "
        f"set [{WORKLOAD_API_SOCKET_ENV}]",
    )
    add(
        "--workload-api-socket-mode",
        help="permissions of the Workload API socket, octal [0600; 0666 lets an application "
        "container running as another user connect]",
    )
    add(
        "--file-mounted-dir",
        help=f"directory of FILE_MOUNTED_CERTS files [{DEFAULT_FILE_MOUNTED_DIR}]",
    )
    add(
        "--credential-bundle",
        help="with FILE_MOUNTED_CERTS: the kubelet's podCertificate credential bundle (PKCS#8 "
        "key, then the chain) instead of cert-chain.pem and key.pem; the root stays "
        "root-cert.pem in --file-mounted-dir [CREDENTIAL_BUNDLE]",
    )
    add(
        "--file-secret-dirs",
        help="colon-separated directories that SDS file-cert:/file-root: names may read from "
        f"[FILE_SECRET_DIRS; {DEFAULT_FILE_SECRET_DIRS}]",
    )
    add("--status-listen", help=f"status/metrics HTTP address [{DEFAULT_STATUS_LISTEN}]")
    add("--ca-request-timeout", help="deadline for one CA call [10s]")
    add(
        "--root-file-poll-interval",
        help="how often the --ca-root file is checked for a new trust bundle [1s]",
    )
    add("--log-level", help="DEBUG, INFO, WARNING, ERROR [INFO]")
    add(
        "--report-interval",
        help="how often to tell a meshca CA which trust bundle and leaf authorities this agent "
        "holds (jittered ±20%%; 1s..1h, 0 turns it off) [2m]",
    )
    add(
        "--taint-resign-window",
        help="leaves signed by an authority the CA has tainted are re-signed at a random point "
        "this long after the taint, so the fleet does not re-sign at once [5m]",
    )
    node = parser.add_argument_group("node mode (one agent per node, ztunnel's pattern)")
    node.add_argument(
        "--node-mode",
        action="store_true",
        default=None,
        help="serve one certificate per (namespace, service account) with pods on this node",
    )
    node.add_argument("--node-name", help="this node's name, to select its pods [NODE_NAME]")
    node.add_argument(
        "--kubeconfig", help="kubeconfig for watching pods [KUBECONFIG; else in-cluster]"
    )
    node.add_argument(
        "--identities",
        help="static identities instead of watching pods: ns/sa,ns/sa (no API server needed)",
    )
    node.add_argument(
        "--identities-file", help="static identities from a file, one ns/sa per line (# comments)"
    )
    node.add_argument(
        "--max-concurrent-fetches",
        type=int,
        help=f"CSRs in flight at once [{DEFAULT_MAX_CONCURRENT_FETCHES}]",
    )


def _build(args: argparse.Namespace, env: Mapping[str, str]) -> AgentConfig:
    def pick(flag: str, var: str | None, default: str | None) -> str | None:
        value = getattr(args, flag, None)
        if value is not None:
            return str(value)
        if var is not None and env.get(var, "") != "":
            return env[var]
        return default

    def duration(flag: str, var: str | None, default: str) -> timedelta:
        text = pick(flag, var, default) or default
        try:
            return parse_duration(text)
        except ValueError as exc:
            raise ConfigError(f"{var or '--' + flag.replace('_', '-')}: {exc}") from exc

    def number(flag: str, var: str, default: float) -> float:
        text = pick(flag, var, None)
        if text is None:
            return default
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{var}={text!r} is not a number") from None

    root = pick("ca_root_ca", "CA_ROOT_CA", DEFAULT_CA_ROOT_CA) or DEFAULT_CA_ROOT_CA
    output = pick("output_certs", "OUTPUT_CERTS", None)
    prov = pick("prov_cert", "PROV_CERT", None)
    host, port = _parse_listen(pick("status_listen", None, DEFAULT_STATUS_LISTEN) or "")
    file_mounted = getattr(args, "file_mounted_certs", None)
    if file_mounted is None:
        file_mounted = _parse_bool("FILE_MOUNTED_CERTS", env.get("FILE_MOUNTED_CERTS", "false"))
    kubeconfig = pick("kubeconfig", "KUBECONFIG", None)
    credential_bundle = pick("credential_bundle", "CREDENTIAL_BUNDLE", None)
    identities_file = pick("identities_file", None, None)
    max_fetches = pick("max_concurrent_fetches", None, str(DEFAULT_MAX_CONCURRENT_FETCHES))
    return AgentConfig(
        ca_addr=pick("ca_addr", "CA_ADDR", DEFAULT_CA_ADDR) or DEFAULT_CA_ADDR,
        ca_root_ca=None if root == SYSTEM_ROOTS else Path(root),
        trust_domain=pick("trust_domain", "TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN)
        or DEFAULT_TRUST_DOMAIN,
        namespace=pick("namespace", "POD_NAMESPACE", None),
        service_account=pick("service_account", "SERVICE_ACCOUNT", None),
        secret_ttl=duration("secret_ttl", "SECRET_TTL", "24h"),
        grace_period_ratio=number("grace_period_ratio", "SECRET_GRACE_PERIOD_RATIO", 0.5),
        grace_period_ratio_jitter=number(
            "grace_period_ratio_jitter", "SECRET_GRACE_PERIOD_RATIO_JITTER", 0.01
        ),
        key_spec=_key_spec(getattr(args, "key_type", None), env),
        output_certs=Path(output) if output else None,
        file_mounted_certs=bool(file_mounted),
        prov_cert=Path(prov) if prov else None,
        cluster_id=pick("cluster_id", "ISTIO_META_CLUSTER_ID", "") or "",
        ca_headers=_ca_headers(env),
        token_path=Path(pick("token_path", None, DEFAULT_TOKEN_PATH) or DEFAULT_TOKEN_PATH),
        sds_socket=Path(pick("sds_socket", None, DEFAULT_SDS_SOCKET) or DEFAULT_SDS_SOCKET),
        sds_socket_mode=_octal_mode(
            pick("sds_socket_mode", None, "0600") or "0600", "--sds-socket-mode"
        ),
        workload_api_socket=_socket_path(
            pick("workload_api_socket", WORKLOAD_API_SOCKET_ENV, None)
        ),
        workload_api_socket_mode=_octal_mode(
            pick("workload_api_socket_mode", None, "0600") or "0600", "--workload-api-socket-mode"
        ),
        file_mounted_dir=Path(
            pick("file_mounted_dir", None, DEFAULT_FILE_MOUNTED_DIR) or DEFAULT_FILE_MOUNTED_DIR
        ),
        credential_bundle=Path(credential_bundle) if credential_bundle else None,
        status_host=host,
        status_port=port,
        ca_request_timeout=duration("ca_request_timeout", None, "10s"),
        root_file_poll_interval=duration("root_file_poll_interval", None, "1s"),
        log_level=(pick("log_level", None, "INFO") or "INFO").upper(),
        node_mode=bool(getattr(args, "node_mode", None)),
        node_name=pick("node_name", "NODE_NAME", None),
        pod_name=env.get("POD_NAME") or None,
        kubeconfig=Path(kubeconfig) if kubeconfig else None,
        in_cluster=bool(env.get("KUBERNETES_SERVICE_HOST")),
        identities=parse_identities(pick("identities", None, "") or "", "--identities"),
        identities_file=Path(identities_file) if identities_file else None,
        max_concurrent_fetches=_int("--max-concurrent-fetches", max_fetches or "0"),
        report_interval=duration("report_interval", None, "2m"),
        taint_resign_window=duration("taint_resign_window", None, "5m"),
        file_secret_dirs=_directories(
            "FILE_SECRET_DIRS", pick("file_secret_dirs", "FILE_SECRET_DIRS", None)
        ),
    )


def _directories(where: str, text: str | None) -> tuple[Path, ...]:
    """`a:b` → (Path(a), Path(b)); absolute paths only (relative ones would depend on the
    agent's working directory); `None` → the default list."""
    if text is None:
        text = DEFAULT_FILE_SECRET_DIRS
    directories = tuple(Path(item) for item in text.split(":") if item.strip())
    relative = [str(d) for d in directories if not d.is_absolute()]
    if relative:
        raise ConfigError(f"{where}: directories must be absolute paths (got {relative})")
    return directories


def parse_identities(text: str, where: str) -> tuple[tuple[str, str], ...]:
    """`ns/sa,ns/sa` (commas or newlines; `#` starts a comment) → ((ns, sa), ...), deduplicated
    in order."""
    try:
        return parse_account_list(text, comments=True)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _int(where: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{where}={text!r} is not an integer") from None


def _key_spec(flag: str | None, env: Mapping[str, str]) -> KeySpec:
    """Flag `--key-type` wins; then Istio's variables; else ECDSA P-256."""
    try:
        if flag:
            return KeySpec.parse(flag)
        algorithm = env.get("ECC_SIGNATURE_ALGORITHM", "").strip().upper()
        rsa_size = env.get("WORKLOAD_RSA_KEY_SIZE", "").strip()
        if algorithm == "ECDSA" or (not algorithm and not rsa_size):
            return KeySpec("ECDSA", curve=env.get("ECC_CURVE", "P256").strip().upper() or "P256")
        if algorithm in ("RSA", ""):
            return KeySpec("RSA", rsa_bits=int(rsa_size or "2048"))
    except ValueError as exc:  # KeyMaterialError is a ValueError too
        raise ConfigError(f"workload key settings: {exc}") from exc
    raise ConfigError(f"ECC_SIGNATURE_ALGORITHM={algorithm!r}: use ECDSA or RSA")


# Headers the agent sets itself; a second copy from CA_HEADER_* makes the request ambiguous,
# and the CA refuses two credentials (or two cluster ids) rather than guess which one counts.
_RESERVED_CA_HEADERS = {
    "authorization": "the token file (--token-file) supplies it",
    "clusterid": "set the cluster with ISTIO_META_CLUSTER_ID / --cluster-id instead",
}


def _ca_headers(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """`CA_HEADER_TENANT=a` → header `tenant: a`, like Istio (gRPC metadata keys are lowercase)."""
    headers = []
    for name, value in sorted(env.items()):
        if name.startswith(CA_HEADER_PREFIX) and len(name) > len(CA_HEADER_PREFIX):
            key = name[len(CA_HEADER_PREFIX) :].lower()
            if key in _RESERVED_CA_HEADERS:
                raise ConfigError(
                    f"{name}: the agent sends `{key}` itself and the CA refuses a request "
                    f"carrying two; {_RESERVED_CA_HEADERS[key]}"
                )
            headers.append((key, value))
    return tuple(headers)


def _parse_bool(var: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{var}={text!r} is not a boolean; use true or false")


def _octal_mode(text: str, where: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise ConfigError(f"{where}={text!r}: expected an octal mode such as 0600") from None
    if mode & ~0o777:
        raise ConfigError(f"{where}={text!r}: only permission bits (0-0777) are allowed")
    return mode


def _socket_path(text: str | None) -> Path | None:
    """`unix:///p`, `unix:/p` or `/p` → Path("/p") (the forms SPIFFE_ENDPOINT_SOCKET takes);
    None or empty → None (the Workload API stays off)."""
    if not text:
        return None
    value = text
    if value.startswith("unix:"):
        value = value[len("unix:") :]
        if value.startswith("//"):
            value = "/" + value.lstrip("/")
    elif "://" in value or value.startswith("tcp:"):
        raise ConfigError(
            f"{WORKLOAD_API_SOCKET_ENV}/--workload-api-socket={text!r}: the agent serves the "
            "Workload API on a Unix socket only; give unix:PATH or a path"
        )
    if not value:
        raise ConfigError(f"--workload-api-socket={text!r}: no path given")
    if socket_path_bytes(value) > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"--workload-api-socket={text!r} is longer than {MAX_SOCKET_PATH_BYTES} bytes, the "
            "Unix socket limit; choose a shorter path"
        )
    return Path(value)


def socket_path_bytes(path: str | os.PathLike[str]) -> int:
    """What serving on the socket `path` takes of `MAX_SOCKET_PATH_BYTES`: its own length, or
    that of the name the agent first binds beside it (`agent.unix_socket`), whichever is more."""
    beside = len(os.fsencode(Path(path).parent)) + 1 + SOCKET_BIND_NAME_BYTES
    return max(len(os.fsencode(path)), beside)


def _parse_listen(text: str) -> tuple[str, int]:
    try:
        return parse_listen("--status-listen", text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
