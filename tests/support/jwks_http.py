"""A JWKS served over HTTP on loopback, for the CA's `--jwt-issuer ...jwks_url` paths."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

from tests.support.quiet_http import QuietThreadingHTTPServer


@contextlib.contextmanager
def serve_jwks(body: bytes) -> Iterator[str]:
    """Serves `body` (a JWKS document) to every GET; yields its URL until the block ends."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    server = QuietThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/openid/v1/jwks"
    finally:
        server.shutdown()
        server.server_close()
