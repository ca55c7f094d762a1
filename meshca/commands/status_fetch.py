"""`meshca status`'s fetching: an address, or the shared state, read into one `Snapshot`.

An agent's status address gives `/debug/secrets`; its SDS socket (`unix:PATH`) is asked what a
proxy would (`meshca.sds_fetch`), and a socket that does not speak SDS as an application asks
the SPIFFE Workload API (`meshca.workload_api_fetch`); a CA's debug address gives `/debug/ca`
and the counters of `/metrics`; `--data-dir`/`--kubeconfig` give the shared state through
`meshca.commands.authority_view`. Which daemon answers is found by asking (`fetch`).

Whatever answers is not trusted to be a meshca daemon (`meshca.careful_http`): each request has
one deadline and a size cap (`Limits`), redirects are reported, never followed, and anything
but the documents a meshca daemon sends is a `StatusError` saying what answered and how. The
address forms read only the daemons' wire formats (HTTP, JSON, SDS, the Workload API); they
never import `agent`. The shared-state form reads through the authority facade
(`ca_server.authority`), like `meshca authority`; the Kubernetes client is loaded only for
`--kubeconfig`. Drawing a snapshot is `meshca.commands.status_render`'s.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ca_server.authority import AuthorityCommandError, CaSetupError, SlotFactory, status_section
from certs import DEFAULT_TRUST_DOMAIN, KeySpec
from meshca import careful_http
from meshca.commands import authority_view

AGENT_PATH = "/debug/secrets"
CA_PATH = "/debug/ca"
METRICS_PATH = "/metrics"
METRICS_TYPES = ("text/plain", "application/openmetrics-text")
DEFAULT_TIMEOUT_SECONDS = 5.0
# A CA's /debug/ca grows with its fleet (agents' rows); 16 MiB is far above a large one.
DEFAULT_MAX_RESPONSE_MIB = 16
SDS_PREFIX = "unix:"
SDS_DEFAULT_RESOURCES = ("default", "ROOTCA")
SHARED_STATE = "ca-state"  # the kind of document read from the shared state, not a CA


class StatusError(Exception):
    """The address did not answer like a meshca agent or CA; the message says what to check."""


def base_url(address: str) -> str:
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
        raise StatusError(f"{unlike(base)}: {path}: {exc}") from None


def unlike(base: str) -> str:
    return f"{base} did not answer like a meshca agent or CA"


def _document(base: str, path: str, answer: careful_http.Answer, kind: str) -> dict[str, Any]:
    """The JSON document of a 200 answer, if it is one a meshca daemon of `kind` sends."""
    where = f"{unlike(base)}: {path}"
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
                f"{unlike(base)}: {path} answered HTTP {answer.status}, a redirect to "
                f"{answer.location or '(no Location)'}, which meshca status does not follow: "
                "give the daemon's own address"
            )
    return StatusError(
        f"{unlike(base)}: {AGENT_PATH}: HTTP {agent.status}, {CA_PATH}: HTTP {ca.status}; give "
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
    base = base_url(address)
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
        raise StatusError(f"{unlike(base)}: {METRICS_PATH} answered HTTP {metrics.status}")
    if metrics.content_type not in METRICS_TYPES:
        raise StatusError(
            f"{unlike(base)}: {METRICS_PATH} is {metrics.content_type or 'untyped'}, not "
            "Prometheus text"
        )
    try:
        counters = parse_counters(metrics.body.decode())
    except (ValueError, TypeError, IndexError) as exc:
        raise StatusError(
            f"{unlike(base)}: {METRICS_PATH} is not Prometheus text ({str(exc)[:80]})"
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
