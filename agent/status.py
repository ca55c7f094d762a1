"""The agent's HTTP status endpoint: `/healthz/ready` for the kubelet, `/metrics` for Prometheus.

Concurrency: `meshca.status_http.StatusServer`, a stdlib HTTP server on its own daemon
thread, so a slow scrape never stalls the event loop that serves SDS and rotates certificates.
Handlers only read: the readiness source's attributes are immutable snapshots replaced by single
assignments, and prometheus_client is thread-safe.

Readiness means "holding a valid (unexpired) certificate, and the event loop is turning", not
"the last CA call worked": while the CA is down the agent keeps serving its cached certificate
and stays ready; while the loop is stuck (`meshca.loop_heartbeat`) it serves nothing and is
not. When not ready the body says why (the last error, or the stall), so `kubectl describe pod`
shows something actionable.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from agent.metrics import AgentMetrics
from meshca.clock import Clock
from meshca.loop_heartbeat import LoopHeartbeat
from meshca.status_http import Response, StatusServer, metrics_route, text

READY_PATH = "/healthz/ready"
METRICS_PATH = "/metrics"


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


def build_status_server(
    host: str,
    port: int,
    readiness: ReadinessSource,
    metrics: AgentMetrics,
    clock: Clock,
    heartbeat: LoopHeartbeat | None = None,
) -> StatusServer:
    """`/healthz/ready` and `/metrics` on `host:port` (port 0 picks a free one); not started."""

    def ready() -> Response:
        is_ready, body = readiness_report(readiness, clock.now(), heartbeat)
        return text(200 if is_ready else 503, body)

    return StatusServer(
        f"{host}:{port}",
        {READY_PATH: ready, METRICS_PATH: metrics_route(metrics.registry)},
        name="agent",
    )
