"""A small, bounded HTTP server for health, readiness and Prometheus metrics, shared by CA and
agent (and for the CA's debug address).

Why not the stdlib `ThreadingHTTPServer`: it spends one thread per connection and waits forever
for a request, so 200 idle sockets cost 200 threads, and every client that hangs up early
prints a `BrokenPipeError` traceback. Here one asyncio loop on its own daemon thread holds
every connection (an idle socket costs a file descriptor, not a thread), and the route
handlers run on a fixed pool of `HANDLER_THREADS` threads, so a slow handler (a big `/metrics`)
stalls neither the loop nor the daemon's own event loop, and the thread count never grows.

Bounds (docs/monitoring.md):
- at most `MAX_CONNECTIONS` open connections; at the cap, the one idle the longest is closed to
  make room, so idle sockets cannot lock a scraper out; with none idle, the new one is closed;
- a request line and headers must arrive within `IDLE_TIMEOUT` of the connection (or of the
  previous response on a kept-alive one), at most `MAX_HEAD_BYTES`, or the connection closes;
- GET and HEAD only, no request body; a response the client does not take within
  `WRITE_TIMEOUT` is dropped;
- a client that disconnects is logged at DEBUG, never as a traceback.

Handlers only read state that the daemons update atomically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from meshca.host_port import join_host_port
from meshca.listen import ListenError, listening_socket

__all__ = ["ListenError", "Response", "Route", "StatusServer", "json_response", "text"]

log = logging.getLogger(__name__)

Response = tuple[int, str, bytes]
Route = Callable[[], Response]

MAX_CONNECTIONS = 64
HANDLER_THREADS = 2
IDLE_TIMEOUT = 10.0
WRITE_TIMEOUT = 10.0
MAX_HEAD_BYTES = 16 * 1024


def text(status: int, body: str) -> Response:
    return status, "text/plain; charset=utf-8", body.encode()


def json_response(document: object) -> Response:
    return 200, "application/json", json.dumps(document, indent=1).encode()


def metrics_route(registry: CollectorRegistry) -> Route:
    return lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry))


class _Connection:
    """One client connection: its writer (to close it) and whether it waits for a request."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def close(self) -> None:
        self.writer.transport.abort()


class StatusServer:
    """Serves `routes` (path → handler) on `listen`; port 0 picks a free one (see `.port`).

    The socket is bound here, so a bad or busy address fails at construction (`ListenError`,
    naming `flag`), before the daemon announces anything."""

    def __init__(
        self,
        listen: str,
        routes: dict[str, Route],
        *,
        name: str = "status",
        flag: str = "--monitoring-listen",
        headers: dict[str, str] | None = None,
    ) -> None:
        self._routes = dict(routes)
        self._headers = [f"{name}: {value}" for name, value in (headers or {}).items()]
        self._name = name
        self._known = ", ".join(sorted(routes))
        self._sock = listening_socket(listen, flag)
        self._pool = ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix=f"{name}-http-handler")
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-http")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        # Connections in the order they became idle (waiting for a request): the first is the
        # one to close when the cap is reached. All open ones are in `_open`.
        self._open: set[_Connection] = set()
        self._idle: dict[_Connection, None] = {}

    @property
    def host(self) -> str:
        return str(self._sock.getsockname()[0])

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{join_host_port(self.host, self.port)}"

    def start(self) -> None:
        self._thread.start()
        self._started.wait(5)

    def stop(self) -> None:
        if self._thread.is_alive() and self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close()

    # -- the loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, sock=self._sock, limit=MAX_HEAD_BYTES)
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for connection in list(self._open):
                connection.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        if len(self._open) >= MAX_CONNECTIONS and not self._make_room():
            connection.close()
            return
        self._open.add(connection)
        try:
            await self._serve_connection(connection, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
            log.debug("%s HTTP client went away: %s", self._name, exc or type(exc).__name__)
        finally:
            self._open.discard(connection)
            self._idle.pop(connection, None)
            connection.close()

    def _make_room(self) -> bool:
        """Closes the connection idle the longest; False when none is idle."""
        for oldest in self._idle:
            del self._idle[oldest]
            log.debug("%s HTTP: %d connections open, closing the oldest idle one", self._name,
                      len(self._open))  # fmt: skip
            oldest.close()
            return True
        return False

    async def _serve_connection(
        self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            self._idle[connection] = None
            try:
                async with asyncio.timeout(IDLE_TIMEOUT):
                    head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                await self._send(writer, text(431, "request head too large\n"), False, True)
                return
            finally:
                self._idle.pop(connection, None)
            request = _parse_head(head)
            if request is None:
                await self._send(writer, text(400, "malformed request\n"), False, True)
                return
            method, path, keep_alive, has_body = request
            if has_body:
                await self._send(writer, text(413, "no request body is accepted\n"), False, True)
                return
            if method not in ("GET", "HEAD"):
                await self._send(writer, text(405, "GET or HEAD only\n"), False, True)
                return
            response = await self._respond(path)
            await self._send(writer, response, method == "HEAD", not keep_alive)
            if not keep_alive:
                return

    async def _respond(self, path: str) -> Response:
        route = self._routes.get(path.split("?", 1)[0])
        if route is None:
            return text(404, f"try {self._known}\n")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, route)
        except Exception:
            log.exception("%s HTTP handler for %s failed", self._name, path)
            return text(500, "internal error; see the daemon's log\n")

    async def _send(
        self, writer: asyncio.StreamWriter, response: Response, head_only: bool, close: bool
    ) -> None:
        status, content_type, body = response
        reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        lines = [
            f"HTTP/1.1 {status} {reason}",
            f"Server: meshca-{self._name}",
            f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            *(self._headers if status == 200 else []),
            *(["Connection: close"] if close else []),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()
        if close:
            with contextlib.suppress(OSError):
                writer.close()


def _parse_head(head: bytes) -> tuple[str, str, bool, bool] | None:
    """(method, path, keep-alive, has a body) from a request head, None when malformed."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        return None
    if not version.startswith("HTTP/1.") or not target.startswith("/"):
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip().lower()
    keep_alive = headers.get("connection", "") != "close" and version == "HTTP/1.1"
    has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
    return method, target, keep_alive, has_body
