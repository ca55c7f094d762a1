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

The address forms read only the daemons' wire formats: HTTP, JSON and (via `meshca.sds_fetch`)
SDS; they never import `agent`. The shared-state form reads through the authority facade
(`ca_server.authority`, the only part of the CA the commands import besides its config), like
`meshca authority`; the Kubernetes client is loaded only for `--kubeconfig`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

from ca_server.authority import AuthorityCommandError, CaSetupError, SlotFactory, status_section
from certs import DEFAULT_TRUST_DOMAIN, KeySpec, format_duration
from meshca import careful_http
from meshca.commands import authority_view
from meshca.durations import parse_duration

AGENT_PATH = "/debug/secrets"
CA_PATH = "/debug/ca"
METRICS_PATH = "/metrics"
METRICS_TYPES = ("text/plain", "application/openmetrics-text")
DEFAULT_TIMEOUT_SECONDS = 5.0
# A CA's /debug/ca grows with its fleet (agents' rows); 16 MiB is far above a large one.
DEFAULT_MAX_RESPONSE_MIB = 16
CLEAR_SCREEN = "\x1b[H\x1b[2J"
SDS_PREFIX = "unix:"
SDS_DEFAULT_RESOURCES = ("default", "ROOTCA")
TYPE_NAMES = {"cert_chain": "Cert Chain", "ca": "CA"}
SHARED_STATE = "ca-state"  # the kind of document read from the shared state, not a CA


class StatusError(Exception):
    """The address did not answer like a meshca agent or CA; the message says what to check."""


# -- fetching ----------------------------------------------------------------------------------


def _base_url(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address.rstrip('/')}"


@dataclass(frozen=True)
class Limits:
    """How long one request may take (connect to last byte) and how much it may read."""

    timeout: float = DEFAULT_TIMEOUT_SECONDS
    max_bytes: int = DEFAULT_MAX_RESPONSE_MIB * 1024 * 1024


def _get(base: str, path: str, limits: Limits) -> careful_http.Answer:
    try:
        return careful_http.get(base + path, limits.timeout, limits.max_bytes)
    except careful_http.Unreachable as exc:
        raise StatusError(f"cannot reach {base}{path}: {exc}") from None
    except careful_http.FetchError as exc:
        raise StatusError(f"{_unlike(base)}: {path}: {exc}") from None


def _unlike(base: str) -> str:
    return f"{base} did not answer like a meshca agent or CA"


def _document(base: str, path: str, answer: careful_http.Answer, kind: str) -> dict[str, Any]:
    """The JSON document of a 200 answer, if it is one a meshca daemon of `kind` sends."""
    where = f"{_unlike(base)}: {path}"
    if answer.content_type != "application/json":
        raise StatusError(f"{where} is {answer.content_type or 'untyped'}, not application/json")
    try:
        document = json.loads(answer.body)
    except (ValueError, RecursionError) as exc:
        raise StatusError(f"{where} is not JSON ({str(exc)[:80]})") from None
    if not isinstance(document, dict) or document.get("kind") != kind:
        raise StatusError(f'{where} is JSON, but not a meshca document ("kind": "{kind}")')
    return document


def _refusal(base: str, agent: careful_http.Answer, ca: careful_http.Answer) -> StatusError:
    """Why neither path gave a document: a redirect (never followed) or some other status."""
    for path, answer in ((AGENT_PATH, agent), (CA_PATH, ca)):
        if 300 <= answer.status < 400:
            return StatusError(
                f"{_unlike(base)}: {path} answered HTTP {answer.status}, a redirect to "
                f"{answer.location or '(no Location)'}, which meshca status does not follow: "
                "give the daemon's own address"
            )
    return StatusError(
        f"{_unlike(base)}: {AGENT_PATH}: HTTP {agent.status}, {CA_PATH}: HTTP {ca.status}; give "
        "an agent's --status-listen address, or a CA's --debug-listen address (its "
        "--monitoring-listen shows no identities, so no /debug/ca)"
    )


@dataclass(frozen=True)
class Snapshot:
    """One reading of a daemon: its JSON document and, for a CA, its counters."""

    kind: str  # "agent" or "ca"
    document: dict[str, Any]
    counters: dict[str, dict[tuple[tuple[str, str], ...], float]]
    taken_at: float  # time.monotonic(), for rates between two snapshots


def fetch(address: str, limits: Limits | None = None, resources: tuple[str, ...] = ()) -> Snapshot:
    limits = limits or Limits()
    if address.startswith(SDS_PREFIX):
        socket = address[len(SDS_PREFIX) :]
        document = sds_document(socket, resources or SDS_DEFAULT_RESOURCES, limits.timeout)
        return Snapshot("agent", document, {}, time.monotonic())
    base = _base_url(address)
    agent = _get(base, AGENT_PATH, limits)
    if agent.status == 200:
        document = _document(base, AGENT_PATH, agent, "agent")
        return Snapshot("agent", document, {}, time.monotonic())
    ca = _get(base, CA_PATH, limits)
    if ca.status != 200:
        raise _refusal(base, agent, ca)
    document = _document(base, CA_PATH, ca, "ca")
    metrics = _get(base, METRICS_PATH, limits)
    if metrics.status != 200:
        raise StatusError(f"{_unlike(base)}: {METRICS_PATH} answered HTTP {metrics.status}")
    if metrics.content_type not in METRICS_TYPES:
        raise StatusError(
            f"{_unlike(base)}: {METRICS_PATH} is {metrics.content_type or 'untyped'}, not "
            "Prometheus text"
        )
    try:
        counters = parse_counters(metrics.body.decode())
    except (ValueError, TypeError, IndexError) as exc:
        raise StatusError(
            f"{_unlike(base)}: {METRICS_PATH} is not Prometheus text ({str(exc)[:80]})"
        ) from None
    return Snapshot("ca", document, counters, time.monotonic())


def fetch_shared_state(args: argparse.Namespace) -> Snapshot:
    """The slots and coverage from the shared state (`--data-dir` or `--kubeconfig`)."""
    name = "meshca status"
    # Only read: the factory would make a first authority, which reading never does.
    factory = SlotFactory(KeySpec.parse("ec-p256"), DEFAULT_TRUST_DOMAIN, timedelta(days=1))
    try:
        with authority_view.open_target(args, factory, "meshca-status") as target:
            if not target.exists:
                raise StatusError(authority_view.no_authorities_message(target))
            state = target.store.read()
            section = status_section(
                state,
                authority_view.read_live_leaves(target.ledgers, name),
                authority_view.read_fleet(target.ledgers, name),
            )
            source = target.store.description
    except (AuthorityCommandError, CaSetupError) as exc:
        raise StatusError(str(exc)) from None
    now = datetime.now(UTC)
    document = {"kind": SHARED_STATE, "source": source, "now": now.isoformat(), **section}
    return Snapshot(SHARED_STATE, document, {}, time.monotonic())


def parse_counters(exposition: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Counter and gauge samples by name and sorted label pairs (`_total` names kept)."""
    values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            values.setdefault(sample.name, {})[labels] = sample.value
    return values


def sds_document(socket: str, names: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """An agent-shaped document from one `FetchSecrets` on the SDS socket (no key is kept)."""
    from meshca.sds_fetch import SdsFetchError, fetch_certificates

    try:
        served = fetch_certificates(socket, names, timeout)
    except SdsFetchError as exc:
        if exc.code != "UNIMPLEMENTED":
            raise StatusError(str(exc)) from None
        return workload_api_document(socket, timeout)
    return served_document(served, "sds")


def workload_api_document(socket: str, timeout: float) -> dict[str, Any]:
    """An agent-shaped document from one `FetchX509SVID` (the key is dropped on arrival)."""
    from meshca.workload_api_fetch import WorkloadApiFetchError, fetch_svids

    try:
        served = fetch_svids(socket, timeout)
    except WorkloadApiFetchError as exc:
        raise StatusError(str(exc)) from None
    return served_document(served, "workload-api")


def served_document(served: dict[str, tuple[str, Any, int]], source: str) -> dict[str, Any]:
    """The agent-shaped document for certificates read off a socket (no rotation state)."""
    now = datetime.now(UTC)
    entries = []
    for name in sorted(served):
        kind, certificate, count = served[name]
        not_before, not_after = certificate.not_valid_before_utc, certificate.not_valid_after_utc
        valid = not_before <= now < not_after
        entries.append(
            {
                "resource_name": name,
                "type": kind,
                "status": "ACTIVE"
                if valid
                else ("EXPIRED" if now >= not_after else "NOT_YET_VALID"),
                "valid": valid,
                "serial": f"{certificate.serial_number:x}",
                "not_before": not_before.isoformat(),
                "not_after": not_after.isoformat(),
                "time_left_seconds": (not_after - now).total_seconds(),
                "certificates": count,
                "lifetime_seconds": None,
                "last_renewal": None,
                "next_rotation": None,
                "consecutive_failures": 0,
                "last_error": None,
                "last_error_at": None,
            }
        )
    return {"kind": "agent", "source": source, "now": now.isoformat(), "secrets": entries}


# -- agent -------------------------------------------------------------------------------------


def _time(text: str | None) -> str:
    if text is None:
        return "-"
    return datetime.fromisoformat(text).strftime("%Y-%m-%dT%H:%M:%SZ")


def _left(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return "EXPIRED" if seconds <= 0 else format_duration(timedelta(seconds=seconds))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [headers, *rows]]  # fmt: skip
    return "\n".join(lines)


def render_agent(document: dict[str, Any]) -> str:
    headers = [
        "RESOURCE NAME", "TYPE", "STATUS", "VALID CERT", "SERIAL NUMBER", "NOT BEFORE",
        "NOT AFTER", "TIME LEFT", "NEXT ROTATION", "LAST ERROR",
    ]  # fmt: skip
    rows = [
        [
            entry["resource_name"],
            TYPE_NAMES.get(entry["type"], "-"),
            entry["status"],
            "true" if entry["valid"] else "false",
            entry["serial"] or "-",
            _time(entry["not_before"]),
            _time(entry["not_after"]),
            _left(entry["time_left_seconds"]),
            _time(entry["next_rotation"]),
            _error(entry),
        ]
        for entry in document["secrets"]
    ]
    text = _table(headers, rows) if rows else "the agent serves no secrets yet"
    workload_api = document.get("workload_api")
    if workload_api is not None:
        text += "\n\n" + render_workload_api(workload_api)
    return text


def render_workload_api(summary: dict[str, Any]) -> str:
    """What the agent's SPIFFE Workload API serves (`agent.workload.api` summary)."""
    rows = [
        [rpc, str(summary["streams_open"].get(rpc, 0)), str(responses)]
        for rpc, responses in summary["responses"].items()
    ]
    refusals = summary.get("refusals") or {}
    refused = (
        "refused: " + ", ".join(f"{reason} {count}" for reason, count in sorted(refusals.items()))
        if refusals
        else "no calls refused"
    )
    return "\n".join(
        [
            f"SPIFFE Workload API on unix:{summary['socket']}: {summary['serves']}",
            _table(["WORKLOAD API RPC", "STREAMS OPEN", "RESPONSES SENT"], rows),
            refused,
        ]
    )


def _error(entry: dict[str, Any]) -> str:
    error = entry.get("last_error")
    if not error:
        return "-"
    failures = entry.get("consecutive_failures", 0)
    return f"({failures} in a row) {error}" if failures else error


# -- CA ----------------------------------------------------------------------------------------

ISSUED = "meshca_ca_certificates_issued_total"
REQUESTS = "meshca_ca_csr_requests_total"
DENIALS = "meshca_ca_denials_total"
IN_FLIGHT = "meshca_ca_requests_in_flight"


def ca_rates(current: Snapshot, previous: Snapshot | None) -> dict[str, Any]:
    """Totals and per-second rates, over the last interval (`previous`) or since the CA started."""
    if previous is not None:
        window = max(current.taken_at - previous.taken_at, 1e-9)
        before = previous.counters
        over = "last interval"
    else:
        started = datetime.fromisoformat(current.document["started"])
        now = datetime.fromisoformat(current.document["now"])
        window = max((now - started).total_seconds(), 1e-9)
        before = {}
        over = "since start"

    def total(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return current.counters.get(name, {}).get(labels, 0.0)

    def rate(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return (total(name, labels) - before.get(name, {}).get(labels, 0.0)) / window

    refusals = []
    for labels in sorted(current.counters.get(DENIALS, {})):
        label_map = dict(labels)
        refusals.append(
            {
                "reason": label_map.get("reason", ""),
                "code": label_map.get("code", ""),
                "total": total(DENIALS, labels),
                "per_second": rate(DENIALS, labels),
            }
        )
    return {
        "over": over,
        "window_seconds": window,
        "requests": {"total": total(REQUESTS), "per_second": rate(REQUESTS)},
        "issued": {"total": total(ISSUED), "per_second": rate(ISSUED)},
        "in_flight": total(IN_FLIGHT),
        "refusals": refusals,
    }


def ca_json(current: Snapshot, previous: Snapshot | None) -> dict[str, Any]:
    return {**current.document, "rates": ca_rates(current, previous)}


def render_ca(document: dict[str, Any]) -> str:
    rates = document["rates"]
    parts = [
        f"CA started {_time(document['started'])}; leaves may last until the chain expires "
        f"{_time(document['chain_not_after'])}; "
        f"first root expires {_time(document['root_not_after'])}",
        "",
        _table(
            ["ROLE", "SERIAL NUMBER", "NOT BEFORE", "NOT AFTER", "TIME LEFT", "SUBJECT"],
            [
                [
                    c["role"],
                    c["serial"],
                    _time(c["not_before"]),
                    _time(c["not_after"]),
                    _left(c["time_left_seconds"]),
                    c["subject"],
                ]
                for c in document["certificates"]
            ],
        ),
        "",
        render_slots(document),
        "",
        f"requests {rates['requests']['total']:.0f} ({rates['requests']['per_second']:.2f}/s), "
        f"issued {rates['issued']['total']:.0f} ({rates['issued']['per_second']:.2f}/s), "
        f"in flight {rates['in_flight']:.0f}  [rates {_rates_over(rates)}]",
    ]
    if rates["refusals"]:
        parts += [
            "",
            _table(
                ["REFUSED FOR", "CODE", "TOTAL", "PER SECOND"],
                [
                    [r["reason"], r["code"], f"{r['total']:.0f}", f"{r['per_second']:.2f}"]
                    for r in rates["refusals"]
                ],
            ),
        ]
    else:
        parts += ["no requests refused"]
    leaves = document["soonest_expiring_leaves"]
    parts += ["", f"soonest-expiring leaves ({len(leaves)} of {document['leaves_known']} known):"]
    if leaves:
        parts.append(
            _table(
                ["IDENTITY", "SERIAL NUMBER", "ISSUED", "NOT AFTER", "TIME LEFT"],
                [
                    [
                        leaf["identity"],
                        leaf["serial"],
                        _time(leaf["issued_at"]),
                        _time(leaf["not_after"]),
                        _left(leaf["time_left_seconds"]),
                    ]
                    for leaf in leaves
                ],
            )
        )
    return "\n".join(parts)


def _rates_over(rates: dict[str, Any]) -> str:
    if rates["over"] == "since start":
        return "per second since the CA started; --watch shows the last interval"
    return f"per second over the last {format_duration(timedelta(seconds=rates['window_seconds']))}"


def render_slots(document: dict[str, Any]) -> str:
    """The authority slots and their coverage, or why a CA has none."""
    if document.get("authorities") is None:
        return (
            "authority slots: none (a plugged-in CA: its authorities are rotated through "
            "--cacerts-dir, docs/rotate-the-ca.md)"
        )
    return "\n".join(
        [
            "authorities:",
            authority_view.render_authorities(document),
            "",
            authority_view.render_coverage(document["coverage"]),
        ]
    )


def render_shared_state(document: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"CA shared state: {document['source']} (read without a running CA: rates and "
            "leaves are only in a running CA, `meshca status <its monitoring address>`)",
            "",
            render_slots(document),
        ]
    )


# -- command -----------------------------------------------------------------------------------


def render(current: Snapshot, previous: Snapshot | None, output: str) -> str:
    if current.kind in ("agent", SHARED_STATE):
        document = current.document
        if output == "json":
            return json.dumps(document, indent=2)
        return render_agent(document) if current.kind == "agent" else render_shared_state(document)
    ca = ca_json(current, previous)
    return json.dumps(ca, indent=2) if output == "json" else render_ca(ca)


def render_checked(current: Snapshot, previous: Snapshot | None, output: str, where: str) -> str:
    """`render`, with a document that lacks or mangles a field it needs said as one line: the
    shape was checked only at the top (`kind`), whatever answered may have sent the rest."""
    try:
        return render(current, previous, output)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        field = f"field {exc}" if isinstance(exc, KeyError) else f"a field ({str(exc)[:80]})"
        raise StatusError(f"{_unlike(where)}: its document lacks or mangles {field}") from None


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
        return _base_url(address)
    return _what(args)


def _what(args: argparse.Namespace) -> str:
    if args.address is not None:
        return str(args.address)
    if args.data_dir is not None:
        return f"--data-dir {args.data_dir}"
    return f"--kubeconfig {args.kubeconfig} --namespace {args.namespace}"
