"""The agent's HTTP status endpoint: `/healthz/ready` for the kubelet, `/metrics` for Prometheus,
`/debug/secrets` (JSON, one entry per served secret) for `meshca status`.

Concurrency: `meshca.status_http.StatusServer`, a bounded HTTP server with its own loop on its
own daemon thread, so a slow scrape never stalls the event loop that serves SDS and rotates
certificates, and idle clients cost no threads.
Handlers only read: the readiness source's attributes are immutable snapshots replaced by single
assignments, and prometheus_client is thread-safe.

Readiness means "holding a valid (unexpired) certificate, and the event loop is turning", not
"the last CA call worked": while the CA is down the agent keeps serving its cached certificate
and stays ready; while the loop is stuck (`meshca.loop_heartbeat`) it serves nothing and is
not. When not ready the body says why (the last error, or the stall), so `kubectl describe pod`
shows something actionable.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from agent.metrics import AgentMetrics
from agent.secret_status import SecretReport, SecretStatus
from meshca.clock import Clock
from meshca.host_port import join_host_port
from meshca.loop_heartbeat import LoopHeartbeat
from meshca.status_http import Response, StatusServer, json_response, metrics_route, text

READY_PATH = "/healthz/ready"
METRICS_PATH = "/metrics"
SECRETS_PATH = "/debug/secrets"


class ReadinessSource(Protocol):
    """What the status endpoint asks (the Agent's `certificate_source.CertificateSource`)."""

    def has_valid_certificate(self, now: datetime | None = None) -> bool: ...

    @property
    def last_error(self) -> str | None: ...


def readiness_report(
    source: ReadinessSource, now: datetime, heartbeat: LoopHeartbeat | None = None
) -> tuple[bool, str]:
    """(ready, body): the readiness decision and the text explaining it."""
    stalled = heartbeat.stalled_for() if heartbeat is not None else None
    if stalled is not None:
        return False, (
            f"not ready: the agent's event loop has not run for {stalled:.1f}s "
            "(something is blocking it; SDS and rotation are stalled)\n"
        )
    error = source.last_error
    if source.has_valid_certificate(now):
        body = "ready: holding a valid certificate\n"
        if error:
            body += f"last renewal attempt failed (retrying): {error}\n"
        return True, body
    reason = error or "no certificate obtained yet"
    return False, f"not ready: {reason}\n"


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def secret_entry(report: SecretReport, now: datetime) -> dict[str, Any]:
    """One `/debug/secrets` entry; the field names are what `meshca status -o json` prints."""
    served, renewal = report.served, report.renewal
    return {
        "resource_name": report.resource_name,
        "type": served.type if served else None,
        "status": report.status(now),
        "valid": report.valid(now),
        "serial": served.serial_hex if served else None,
        "not_before": _iso(served.not_before if served else None),
        "not_after": _iso(served.not_after if served else None),
        "time_left_seconds": (served.not_after - now).total_seconds() if served else None,
        "certificates": served.certificates if served else 0,
        "lifetime_seconds": report.lifetime_seconds(),
        "last_renewal": _iso(renewal.last_renewal if renewal else None),
        "next_rotation": _iso(renewal.next_rotation if renewal else None),
        "consecutive_failures": renewal.consecutive_failures if renewal else 0,
        "last_error": renewal.last_error if renewal else None,
        "last_error_at": _iso(renewal.last_error_at if renewal else None),
    }


def secrets_document(
    board: SecretStatus, now: datetime, workload_api: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `/debug/secrets` body: the time it was taken and one entry per resource name, plus
    what the Workload API serves when it is on (`agent.workload.api.WorkloadApiServer.summary`)."""
    document: dict[str, Any] = {
        "kind": "agent",
        "now": now.isoformat(),
        "secrets": [secret_entry(report, now) for report in board.reports()],
    }
    if workload_api is not None:
        document["workload_api"] = workload_api
    return document


def build_status_server(
    host: str,
    port: int,
    readiness: ReadinessSource,
    metrics: AgentMetrics,
    clock: Clock,
    heartbeat: LoopHeartbeat | None = None,
    *,
    workload_api: Callable[[], dict[str, Any]] | None = None,
) -> StatusServer:
    """`/healthz/ready`, `/metrics` and `/debug/secrets` on `host:port` (port 0 picks a free
    one); not started. The secrets endpoint holds no key material: serials and dates only."""

    def ready() -> Response:
        is_ready, body = readiness_report(readiness, clock.now(), heartbeat)
        return text(200 if is_ready else 503, body)

    def secrets() -> Response:
        summary = workload_api() if workload_api is not None else None
        return json_response(secrets_document(metrics.secrets, clock.now(), summary))

    return StatusServer(
        join_host_port(host, port),
        {
            READY_PATH: ready,
            METRICS_PATH: metrics_route(metrics.registry),
            SECRETS_PATH: secrets,
        },
        name="agent",
        flag="--status-listen",
    )
