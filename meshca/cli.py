"""`meshca` — one command, with a subcommand per program.

Each subcommand turns its flags into that program's typed configuration in one place and hands
it over; nothing below reads flags or environment variables again.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.config import DEFAULT_AUDIENCE, CaConfig, JwtIssuerConfig, TtlPolicy
from certs import DEFAULT_TRUST_DOMAIN, CertsError, KeySpec, describe_certificate, load_certs
from certs.inspect import format_duration
from meshca.durations import parse_duration
from meshca.logs import configure_logging


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


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
        "--serving-host",
        action="append",
        default=[],
        help="DNS name or IP for the CA's TLS certificate (repeatable)",
    )
    ca.add_argument(
        "--ca-reload-interval",
        type=_duration,
        default="5s",
        help="how often to check the CA files (plugged-in or shared root) for changes",
    )
    ca.add_argument("--log-level", default="INFO")
    ca.set_defaults(run=_run_ca)


def ca_config_from_args(args: argparse.Namespace) -> CaConfig:
    if len(args.jwks) != len(args.jwt_issuer):
        raise SystemExit("meshca ca: give one --jwt-issuer for each --jwks")
    audiences = tuple(args.audience) or (DEFAULT_AUDIENCE,)
    issuers = tuple(
        JwtIssuerConfig(issuer, jwks, audiences)
        for issuer, jwks in zip(args.jwt_issuer, args.jwks, strict=True)
    )
    trust_dev = args.dev_issuer if args.dev_issuer is not None else not issuers
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshca", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_ca_parser(subparsers)
    _add_token_parser(subparsers)
    _add_inspect_parser(subparsers)
    _add_agent_parsers(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))
