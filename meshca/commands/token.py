"""`meshca token`: mint a development service-account token that the local CA trusts."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path

from ca_server import duration_argument
from ca_server.config import DEFAULT_AUDIENCE


@dataclass(frozen=True)
class TokenRequest:
    """Which token to mint, and with whose key (the dev issuer in `data_dir`)."""

    data_dir: Path
    namespace: str
    service_account: str
    audience: str = DEFAULT_AUDIENCE
    ttl: timedelta = timedelta(hours=1)
    pod_name: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> TokenRequest:
        """Flags only: the environment is accepted for the common shape and not consulted."""
        del environ
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls)})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--service-account", required=True)
    parser.add_argument("--audience", default=DEFAULT_AUDIENCE)
    parser.add_argument("--ttl", type=duration_argument, default="1h")
    parser.add_argument("--pod-name", default=None)


def run(args: argparse.Namespace) -> int:
    from ca_server import DevIssuerMissing, load_dev_issuer

    request = TokenRequest.from_args(args, {})
    if request.ttl <= timedelta(0):
        print("meshca token: --ttl must be longer than 0s, e.g. 1h", file=sys.stderr)
        return 2
    try:
        issuer = load_dev_issuer(request.data_dir)
    except DevIssuerMissing as exc:
        print(f"meshca token: {exc}", file=sys.stderr)
        return 2
    print(
        issuer.mint(
            request.namespace,
            request.service_account,
            audience=request.audience,
            ttl=request.ttl,
            pod_name=request.pod_name,
        )
    )
    return 0
