"""A loopback HTTP server that answers like anything but a meshca daemon, for `meshca status`.

Each mode is a function given the request path and the connected socket; it writes whatever
that mode's peer would (broken HTTP, a redirect, a body that never ends...) and returns. The
server records every connection, so a test can tell that a redirect's target was never asked.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

Mode = Callable[[str, socket.socket, threading.Event], None]


def _head(status: str, content_type: str | None, length: int | None, *extra: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", "Connection: close"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode()


def answer(status: str, content_type: str | None, body: bytes, *extra: str) -> Mode:
    def send(path: str, sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(_head(status, content_type, len(body), *extra) + body)

    return send


def per_path(routes: dict[str, Mode], default: Mode) -> Mode:
    def send(path: str, sock: socket.socket, stop: threading.Event) -> None:
        routes.get(path, default)(path, sock, stop)

    return send


def not_found() -> Mode:
    return answer("404 Not Found", "text/plain", b"no\n")


def raw(data: bytes) -> Mode:
    def send(path: str, sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(data)

    return send


def reset() -> Mode:
    """Closes with SO_LINGER 0: the client's next read sees a TCP reset."""

    def send(path: str, sock: socket.socket, stop: threading.Event) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    return send


def silent_close() -> Mode:
    return lambda path, sock, stop: None


def drip(head: bytes, every: float = 0.2) -> Mode:
    """Sends `head` at once, then one byte of a never-ending body every `every` seconds."""

    def send(path: str, sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(head)
        while not stop.wait(every):
            sock.sendall(b" ")

    return send


def drip_head(every: float = 0.2) -> Mode:
    """A status line and then one header byte every `every` seconds: the head never ends."""

    def send(path: str, sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not stop.wait(every):
            sock.sendall(b"a")

    return send


def endless_body(total: int, content_type: str = "application/json") -> Mode:
    """A 200 with no Content-Length and `total` bytes of body (read until the close)."""

    def send(path: str, sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(_head("200 OK", content_type, None))
        chunk = b"[" * (1024 * 1024)
        sent = 0
        while sent < total and not stop.is_set():
            sock.sendall(chunk)
            sent += len(chunk)

    return send


def json_answer(document: object, content_type: str = "application/json") -> Mode:
    return answer("200 OK", content_type, json.dumps(document).encode())


class GarbageServer:
    """Serves `mode` on a free loopback port until closed; `connections` counts the clients."""

    def __init__(self, mode: Mode) -> None:
        self._mode = mode
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self.connections = 0
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, sock: socket.socket) -> None:
        with sock, contextlib.suppress(OSError):
            sock.settimeout(10)
            head = b""
            while b"\r\n\r\n" not in head:
                data = sock.recv(4096)
                if not data:
                    return
                head += data
            path = head.split(b" ", 2)[1].decode("latin-1")
            self._mode(path, sock, self._stop)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        for thread in self._threads:
            thread.join(5)


@contextlib.contextmanager
def garbage_server(mode: Mode) -> Iterator[GarbageServer]:
    server = GarbageServer(mode)
    try:
        yield server
    finally:
        server.close()


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
