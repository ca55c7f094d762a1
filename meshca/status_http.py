"""A small HTTP server for health, readiness and Prometheus metrics, shared by CA and agent.

It runs in its own daemon thread (stdlib `ThreadingHTTPServer`) so a scrape never waits on the
event loop, and the handlers only read state that the daemons update atomically.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Response = tuple[int, str, bytes]
Route = Callable[[], Response]


def text(status: int, body: str) -> Response:
    return status, "text/plain; charset=utf-8", body.encode()


def json_response(document: object) -> Response:
    return 200, "application/json", json.dumps(document, indent=1).encode()


def metrics_route(registry: CollectorRegistry) -> Route:
    return lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry))


def split_host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class StatusServer:
    """Serves `routes` (path → handler) on `listen`; port 0 picks a free one (see `.port`)."""

    def __init__(self, listen: str, routes: dict[str, Route], *, name: str = "status") -> None:
        host, port = split_host_port(listen)
        known = ", ".join(sorted(routes))

        class Handler(BaseHTTPRequestHandler):
            server_version = f"meshca-{name}"

            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                status, content_type, body = route() if route else text(404, f"try {known}\n")
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes and probes are not worth a log line each

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name=f"{name}-http"
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

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
