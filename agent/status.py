"""The agent's HTTP status endpoint: `/healthz/ready` for the kubelet, `/metrics` for Prometheus.

Concurrency: a stdlib `ThreadingHTTPServer` on its own daemon thread, so a slow scrape never
stalls the event loop that serves SDS and rotates certificates. Handlers only read: the
readiness source's attributes are immutable snapshots replaced by single assignments, and
prometheus_client is thread-safe.

Readiness means "holding a valid (unexpired) certificate", not "the last CA call worked": while
the CA is down the agent keeps serving its cached certificate and stays ready. When not ready
the body says why (the last error), so `kubectl describe pod` shows something actionable.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from agent.metrics import AgentMetrics
from meshca.clock import Clock

log = logging.getLogger(__name__)

READY_PATH = "/healthz/ready"
METRICS_PATH = "/metrics"


class ReadinessSource(Protocol):
    """What the status endpoint asks (implemented by `SecretManager`)."""

    def has_valid_certificate(self, now: datetime | None = None) -> bool: ...

    @property
    def last_error(self) -> str | None: ...


def readiness_report(source: ReadinessSource, now: datetime) -> tuple[bool, str]:
    """(ready, body): the readiness decision and the text explaining it."""
    error = source.last_error
    if source.has_valid_certificate(now):
        body = "ready: holding a valid certificate\n"
        if error:
            body += f"last renewal attempt failed (retrying): {error}\n"
        return True, body
    reason = error or "no certificate obtained yet"
    return False, f"not ready: {reason}\n"


class StatusServer:
    """Serves readiness and metrics on `host:port` (port 0 picks a free one, see `.port`)."""

    def __init__(
        self,
        host: str,
        port: int,
        readiness: ReadinessSource,
        metrics: AgentMetrics,
        clock: Clock,
    ) -> None:
        handler = _make_handler(readiness, metrics, clock)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="agent-status", daemon=True
        )

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        log.info("status server on %s (%s, %s)", self.url, READY_PATH, METRICS_PATH)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


def _make_handler(
    readiness: ReadinessSource, metrics: AgentMetrics, clock: Clock
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "meshca-agent"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == READY_PATH:
                ready, body = readiness_report(readiness, clock.now())
                self._send(200 if ready else 503, body.encode(), "text/plain; charset=utf-8")
            elif path == METRICS_PATH:
                self._send(200, metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._send(404, b"not found; try /healthz/ready or /metrics\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("status %s - %s", self.address_string(), format % args)

    return Handler
