"""One careful HTTP GET, for `meshca status` reading a daemon that may not be one: whatever
answers on an address must not hang the command, fill its memory or send it elsewhere.

- One deadline, `timeout`, from connecting to the last byte of the body. Each socket read is
  bounded too, but a server that drips a byte a second would pass every per-read timeout, so a
  watchdog timer shuts the socket down at the deadline, which ends a blocked read at once.
- The body is read in chunks and refused once it passes `max_bytes`; a `Content-Length` above
  it is refused before reading anything. Memory stays at about `max_bytes` whatever is sent.
- Redirects are never followed (`http.client` follows none): a 3xx is an answer like any other
  and its `Location` is reported, so the operator sees where it pointed.
- The head is bounded by `http.client` itself (64 KiB a line, at most 100 headers).

Every failure is a `FetchError` whose message is one line saying what the peer did.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass

CHUNK_BYTES = 64 * 1024


class FetchError(Exception):
    """The GET did not end in a complete HTTP answer; the message says what happened."""


class Unreachable(FetchError):
    """Nothing answered at all: no such host, nothing listening, or no connection in time."""


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str  # the media type only, lowercase ("application/json"); "" when absent
    body: bytes
    location: str | None  # a redirect's target, reported, never followed


def get(url: str, timeout: float, max_bytes: int) -> Answer:
    """GETs `url` (http or https) within `timeout` seconds, reading at most `max_bytes`."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise FetchError(f"bad address {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"bad address {url!r}: give HOST:PORT or http://HOST:PORT")
    deadline = time.monotonic() + timeout
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, port, timeout=timeout)
    expired = threading.Event()
    # The socket itself: `http.client` drops the connection's reference to it once a response
    # says `Connection: close`, and the watchdog must still reach it then.
    sockets: list[socket.socket] = []
    watchdog = threading.Timer(timeout, _cut, (sockets, expired))
    watchdog.daemon = True
    try:
        watchdog.start()
        try:
            connection.connect()
        except OSError as exc:
            raise Unreachable(_describe(exc)) from None
        if connection.sock is not None:
            sockets.append(connection.sock)
        if expired.is_set():
            raise TimeoutError
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", path, headers={"Accept": "application/json, text/plain"})
        response = connection.getresponse()
        body = _read_body(response, max_bytes, deadline)
        if expired.is_set():  # the cut socket read as an end: what came is not the answer
            raise TimeoutError
        content_type = response.getheader("Content-Type") or ""
        return Answer(
            response.status,
            content_type.split(";", 1)[0].strip().lower(),
            body,
            response.getheader("Location"),
        )
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set():
            raise FetchError(
                f"no complete answer within {timeout:g}s (a slow or stuck server; --timeout)"
            ) from None
        raise FetchError(_describe(exc)) from None
    finally:
        watchdog.cancel()
        connection.close()


def _cut(sockets: list[socket.socket], expired: threading.Event) -> None:
    """The watchdog: at the deadline, end whatever read is blocked (a connect has its own
    timeout, the same one)."""
    expired.set()
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _read_body(response: http.client.HTTPResponse, max_bytes: int, deadline: float) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise FetchError(_too_big(max_bytes, f"announced a body of {int(declared)} bytes"))
    body = bytearray()
    while chunk := response.read(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise FetchError(_too_big(max_bytes, "sent a longer body"))
        if time.monotonic() > deadline:
            raise TimeoutError
    if response.length:  # `read` returns short rather than raise when the peer hangs up early
        raise http.client.IncompleteRead(bytes(body), response.length)
    return bytes(body)


def _too_big(max_bytes: int, what: str) -> str:
    limit = f"{max_bytes / (1024 * 1024):g} MiB"
    return f"it {what}, more than the {limit} an answer may take (--max-response-mib)"


def _describe(exc: BaseException) -> str:
    """What the peer did, in words, from what `http.client` or the socket raised."""
    if isinstance(exc, http.client.RemoteDisconnected):
        return "it closed the connection without answering"
    if isinstance(exc, http.client.BadStatusLine):
        return f"it answered something that is not HTTP ({_short(exc.args[0] if exc.args else '')})"
    if isinstance(exc, http.client.IncompleteRead):
        return "it closed the connection in the middle of its answer"
    if isinstance(exc, http.client.LineTooLong):
        return "it sent a header line longer than 64 KiB"
    if isinstance(exc, ConnectionRefusedError):
        return "nothing listens there (connection refused)"
    if isinstance(exc, ConnectionResetError):
        return "it reset the connection"
    if isinstance(exc, TimeoutError):
        return "no answer in time (--timeout)"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    return _short(str(exc)) or type(exc).__name__


def _short(text: object, limit: int = 60) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "..."
