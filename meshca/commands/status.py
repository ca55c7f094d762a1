"""`meshca status ADDRESS`: what an agent serves, or how a CA is doing, as a table or JSON.

Pointed at an agent's status address it prints one row per secret, like `istioctl proxy-config
secret` plus the rotation columns (time left, next rotation, last error), from the agent's
`/debug/secrets`. Pointed at an agent's SDS socket (`unix:PATH`) it asks what a proxy would
(`FetchSecrets` for `default` and `ROOTCA`, or `--resource` names) and prints the same rows from
the certificates themselves; rotation state is not on the SDS wire, so those columns stay empty.
A socket that does not speak SDS (UNIMPLEMENTED) is asked as an application would ask the SPIFFE
Workload API (`FetchX509SVID`, via `meshca.workload_api_fetch`): one row for the caller's SVID
and one for its trust bundle. An agent's status address also reports what its Workload API
serves (streams open, responses, refusals by reason) under the secrets.

Pointed at a CA's debug address (`--debug-listen`: its monitoring port shows no identities) it
prints the signing chain and roots with their expiry, the authority slots as `meshca authority
show` prints them and their coverage (all from `/debug/ca`), issuance and refusal rates by
reason (from `/metrics`, the counters Prometheus scrapes) and the soonest-expiring leaves the CA
knows of. Which daemon answers is found by asking: an agent answers `/debug/secrets`, a CA
`/debug/ca`.

Whatever answers is not trusted to be a meshca daemon (`meshca.careful_http`): each request
has one deadline (`--timeout`) and a size cap (`--max-response-mib`), redirects are reported,
never followed, and anything but the documents a meshca daemon sends ends in one line,
"ADDRESS did not answer like a meshca agent or CA: ...", exit status 1. With `--watch`, a bad
round says so in place of the table and the next round tries again.

Rates: a single run divides each counter by the CA's uptime; `--watch` redraws in place every
`--interval` and shows the rate over the last interval instead. The header line says which.

With `--data-dir D` or `--kubeconfig K [--namespace N]` instead of an address no CA needs to be
running: it reads the shared state as `meshca authority show` does
(`meshca.commands.authority_view`) and prints the slots and coverage; rates and leaves live only
in a running CA's memory, so they are not shown.

Three modules, one job each: `status_fetch` reads an address or the shared state into one
`Snapshot` (the daemons' wire formats only, never `agent`; the shared state through the
authority facade, `ca_server.authority`, like `meshca authority`), `status_render` draws a
snapshot as a table or JSON, and this one is the command: its flags and the `--watch` loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TextIO

from certs import format_duration
from meshca.commands import authority_view
from meshca.commands.status_fetch import (
    DEFAULT_MAX_RESPONSE_MIB,
    DEFAULT_TIMEOUT_SECONDS,
    SDS_PREFIX,
    Limits,
    Snapshot,
    StatusError,
    base_url,
    fetch,
    fetch_shared_state,
)
from meshca.commands.status_render import render_checked
from meshca.durations import parse_duration

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _positive_duration(text: str) -> timedelta:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= timedelta(0):
        raise argparse.ArgumentTypeError(f"{text!r} must be longer than 0s, e.g. 2s")
    return value


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "address",
        nargs="?",
        help="an agent's status address (--status-listen, e.g. 127.0.0.1:15020), its SDS or "
        "Workload API socket (unix:PATH), or a CA's debug address (--debug-listen, "
        "e.g. 127.0.0.1:15015)",
    )
    authority_view.add_target_arguments(parser, where)
    parser.add_argument(
        "--resource",
        action="append",
        default=[],
        help="with unix:PATH, an SDS resource name to ask for (repeatable; default: default and "
        "ROOTCA; in node mode the workloads' SPIFFE IDs)",
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument(
        "-w", "--watch", action="store_true", help="redraw in place until interrupted"
    )
    parser.add_argument(
        "--interval",
        type=_positive_duration,
        default=timedelta(seconds=2),
        help="time between redraws with --watch (default 2s)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_duration,
        default=timedelta(seconds=DEFAULT_TIMEOUT_SECONDS),
        help="the longest one request to the daemon may take, from connecting to its last "
        f"byte (default {DEFAULT_TIMEOUT_SECONDS:g}s)",
    )
    parser.add_argument(
        "--max-response-mib",
        type=_positive_int,
        default=DEFAULT_MAX_RESPONSE_MIB,
        help="refuse an answer longer than this many MiB (default %(default)s)",
    )


def run(
    args: argparse.Namespace,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    out = out or sys.stdout
    previous: Snapshot | None = None
    limits = Limits(args.timeout.total_seconds(), args.max_response_mib * 1024 * 1024)
    every = format_duration(args.interval)
    try:
        while True:
            current: Snapshot | None = None
            try:
                current = (
                    fetch(args.address, limits, tuple(args.resource))
                    if args.address is not None
                    else fetch_shared_state(args)
                )
                text = render_checked(current, previous, args.output, _where(args))
            except StatusError as exc:
                current = None
                if not args.watch:
                    print(f"meshca status: {exc}", file=sys.stderr)
                    return 1
                text = f"meshca status: {exc} (retrying)"
            if not args.watch:
                print(text, file=out)
                return 0
            stamp = datetime.now().astimezone().strftime("%H:%M:%S")
            out.write(f"{CLEAR_SCREEN}meshca status {_what(args)} every {every} - {stamp}\n\n")
            out.write(text + "\n")
            out.flush()
            previous = current or previous
            sleep(args.interval.total_seconds())
    except KeyboardInterrupt:
        return 0


def _where(args: argparse.Namespace) -> str:
    """Who answered, as the one-line errors name it."""
    address = args.address
    if address is not None and not address.startswith(SDS_PREFIX):
        return base_url(address)
    return _what(args)


def _what(args: argparse.Namespace) -> str:
    if args.address is not None:
        return str(args.address)
    if args.data_dir is not None:
        return f"--data-dir {args.data_dir}"
    return f"--kubeconfig {args.kubeconfig} --namespace {args.namespace}"
