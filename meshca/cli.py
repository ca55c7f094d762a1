"""`meshca` — one command, with a subcommand per program.

Each subcommand turns its flags into that program's typed configuration in one place and hands
it over; nothing below reads flags or environment variables again.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.config import (
    DEFAULT_AUDIENCE,
    DEFAULT_CLUSTER_ID,
    DEFAULT_NAMESPACE,
    CaConfig,
    JwtIssuerConfig,
    KubeConfig,
    TtlPolicy,
)
from ca_server.kube.node_authorizer import parse_node_accounts
from certs import DEFAULT_TRUST_DOMAIN, CertsError, KeySpec, describe_certificate, load_certs
from certs.inspect import format_duration
from meshca.durations import parse_duration
from meshca.logs import configure_logging


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


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


def _add_ca_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ca = subparsers.add_parser("ca", help="run the certificate authority (Istio's CA API)")
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
        help="HTTP address for /metrics, /healthz, /ready",
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
    ca.add_argument("--workload-cert-ttl", type=_duration, default="24h")
    ca.add_argument("--max-workload-cert-ttl", type=_duration, default="90d")
    ca.add_argument("--min-workload-cert-ttl", type=_duration, default="10m")
    ca.add_argument(
        "--root-key",
        type=_key_spec,
        default=KeySpec(),
        help="key type of a generated root: ec-p256 (default), ec-p384, rsa-2048...",
    )
    ca.add_argument("--root-ttl", type=_duration, default="3650d")
    ca.add_argument(
        "--ca-reload-interval",
        "--authority-poll-interval",
        dest="ca_reload_interval",
        type=_duration,
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
    ca.add_argument("--log-level", default="INFO")
    ca.set_defaults(run=_run_ca)


IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


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
        default=os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
        help="the CA's own namespace (Secret, Lease); default $POD_NAMESPACE or istio-system",
    )
    kube.add_argument(
        "--cluster-id",
        default=os.environ.get("CLUSTER_ID") or DEFAULT_CLUSTER_ID,
        help="this cluster's id, as sent in the clusterid header (default $CLUSTER_ID)",
    )
    kube.add_argument(
        "--trusted-node-accounts",
        default=os.environ.get("CA_TRUSTED_NODE_ACCOUNTS", ""),
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
        "--root-configmaps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish ConfigMap istio-ca-root-cert in every namespace (Kubernetes mode only)",
    )
    kube.add_argument(
        "--instance-id",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        help="this replica's name in the leader Lease and API user agent (default $POD_NAME)",
    )
    kube.add_argument(
        "--kube-qps", type=_positive(float), default=50.0, help="TokenReview calls/second"
    )
    kube.add_argument("--kube-burst", type=_positive(int), default=100, help="TokenReview burst")


def kube_config_from_args(args: argparse.Namespace) -> KubeConfig | None:
    """Kubernetes mode is on with `--kubeconfig`, or in a pod (in-cluster credentials), unless
    `--no-kubernetes`; `--kubernetes` insists (and fails at start-up without credentials)."""
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and IN_CLUSTER_TOKEN.exists()
    enabled = args.kubernetes
    if enabled is None:
        enabled = args.kubeconfig is not None or in_cluster
    if not enabled:
        return None
    remote = []
    for item in args.remote_kubeconfig:
        cluster_id, sep, path = item.partition("=")
        if not sep or not cluster_id or not path:
            raise SystemExit(f"meshca ca: --remote-kubeconfig {item!r} is not CLUSTER_ID=PATH")
        remote.append((cluster_id, Path(path)))
    try:
        trusted = parse_node_accounts(args.trusted_node_accounts)
    except ValueError as exc:
        raise SystemExit(f"meshca ca: --trusted-node-accounts: {exc}") from exc
    return KubeConfig(
        kubeconfig=args.kubeconfig,
        remote_kubeconfigs=tuple(remote),
        namespace=args.namespace,
        cluster_id=args.cluster_id,
        token_review=args.token_review,
        audiences=tuple(args.audience) or (DEFAULT_AUDIENCE,),
        trusted_node_accounts=trusted,
        instance_id=args.instance_id,
        qps=args.kube_qps,
        burst=args.kube_burst,
        publish_root=args.root_configmaps,
    )


def ca_config_from_args(args: argparse.Namespace) -> CaConfig:
    if len(args.jwks) != len(args.jwt_issuer):
        raise SystemExit("meshca ca: give one --jwt-issuer for each --jwks")
    audiences = tuple(args.audience) or (DEFAULT_AUDIENCE,)
    issuers = tuple(
        JwtIssuerConfig(issuer, jwks, audiences)
        for issuer, jwks in zip(args.jwt_issuer, args.jwks, strict=True)
    )
    kube = kube_config_from_args(args)
    # The development issuer is a local stand-in for the API server: never trusted by default
    # when a real cluster (or real issuer) is configured.
    trust_dev = args.dev_issuer if args.dev_issuer is not None else not (issuers or kube)
    try:
        ttl = TtlPolicy(
            args.workload_cert_ttl, args.max_workload_cert_ttl, args.min_workload_cert_ttl
        )
    except ValueError as exc:
        raise SystemExit(f"meshca ca: {exc}") from exc
    config = CaConfig(
        data_dir=args.data_dir,
        listen=args.listen,
        mtls_listen=args.mtls_listen,
        monitoring_listen=args.monitoring_listen,
        trust_domain=args.trust_domain,
        cacerts_dir=args.cacerts_dir,
        jwt_issuers=issuers,
        trust_dev_issuer=trust_dev,
        ttl=ttl,
        root_key=args.root_key,
        root_lifetime=args.root_ttl,
        plugged_ca_poll_interval=args.ca_reload_interval,
        kube=kube,
    )
    if args.serving_host:
        config = replace(config, serving_hosts=tuple(args.serving_host))
    return config


def _run_ca(args: argparse.Namespace) -> int:
    from ca_server.root_store import CaSetupError
    from ca_server.server import run_ca

    configure_logging(args.log_level)
    config = ca_config_from_args(args)
    try:
        asyncio.run(run_ca(config))
    except CaSetupError as exc:
        print(f"meshca ca: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_token_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    token = subparsers.add_parser(
        "token", help="mint a development service-account token the local CA trusts"
    )
    token.add_argument("--data-dir", type=Path, required=True)
    token.add_argument("--namespace", required=True)
    token.add_argument("--service-account", required=True)
    token.add_argument("--audience", default=DEFAULT_AUDIENCE)
    token.add_argument("--ttl", type=_duration, default="1h")
    token.add_argument("--pod-name", default=None)
    token.set_defaults(run=_run_token)


def _run_token(args: argparse.Namespace) -> int:
    from ca_server.dev_issuer import DevIssuerMissing, load_dev_issuer

    try:
        issuer = load_dev_issuer(args.data_dir)
    except DevIssuerMissing as exc:
        print(f"meshca token: {exc}", file=sys.stderr)
        return 2
    print(
        issuer.mint(
            args.namespace,
            args.service_account,
            audience=args.audience,
            ttl=args.ttl,
            pod_name=args.pod_name,
        )
    )
    return 0


def _add_inspect_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = subparsers.add_parser("inspect", help="describe PEM certificates")
    inspect.add_argument("files", nargs="+", type=Path)
    inspect.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    status = 0
    for path in args.files:
        try:
            certificates = load_certs(path.read_bytes(), what=str(path))
        except (OSError, CertsError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            status = 1
            continue
        for index, cert in enumerate(certificates):
            info = describe_certificate(cert)
            print(f"{path} [{index}]")
            print(f"  identity:   {info.identity or '-'}")
            print(f"  subject:    {info.subject or '-'}")
            print(f"  issuer:     {info.issuer or '-'}")
            print(f"  serial:     {info.serial_hex}")
            print(f"  ca:         {'yes' if info.is_ca else 'no'}")
            print(f"  not before: {info.not_before.isoformat()}")
            print(f"  not after:  {info.not_after.isoformat()}")
            left = info.time_left(now)
            print(
                f"  time left:  {format_duration(left) if left.total_seconds() > 0 else 'EXPIRED'}"
            )
    return status


def _add_agent_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent.config import add_agent_arguments
    from agent.up import add_up_arguments

    agent = subparsers.add_parser("agent", help="run the per-pod agent (certificates, SDS, files)")
    add_agent_arguments(agent)
    agent.set_defaults(run=_run_agent)
    up = subparsers.add_parser("up", help="run a local CA and one agent, for trying meshca")
    add_up_arguments(up)
    up.set_defaults(run=_run_up)


def _run_agent(args: argparse.Namespace) -> int:
    from agent.main import run_agent_command

    return run_agent_command(args)


def _run_up(args: argparse.Namespace) -> int:
    from agent.up import run_up_command

    return run_up_command(args)


def installed_version() -> str:
    """The version of the installed distribution: what a bug report needs. A source tree run
    without installing has no distribution metadata, and says so rather than guessing."""
    try:
        return importlib.metadata.version("meshca")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshca", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_ca_parser(subparsers)
    _add_token_parser(subparsers)
    _add_inspect_parser(subparsers)
    _add_agent_parsers(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))
