"""`meshca inspect`: describe the certificates in PEM files (identity, issuer, validity)."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from certs import CertsError, describe_certificate, format_duration, load_certs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path)


def run(args: argparse.Namespace) -> int:
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
