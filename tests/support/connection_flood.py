"""Many idle connections to a gRPC Unix socket, each told apart as kept or closed by the server.

A flood connection speaks just enough HTTP/2 to be a real client in grpc's eyes (the preface
and an empty SETTINGS frame) and then idles. A connection the server keeps answers with its own
SETTINGS frame; one the server closed at accept reads end-of-file (or a reset).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = bytes.fromhex("000000040000000000")  # length 0, type SETTINGS, no flags
SETTINGS_ACK = bytes.fromhex("000000040100000000")  # length 0, type SETTINGS, flag ACK


class Flood:
    """The open flood connections; `kept` and `closed` once `classify` has read each."""

    def __init__(self, connections: list[socket.socket]) -> None:
        self.connections = connections
        self.kept: list[socket.socket] = []
        self.closed: list[socket.socket] = []

    def classify(self, timeout: float = 10) -> None:
        """Reads each connection's first bytes: an answer is kept (acknowledged, and held
        open), end-of-file or a reset is closed."""
        for connection in self.connections:
            connection.settimeout(timeout)
            try:
                answer = connection.recv(64)
            except ConnectionResetError:
                answer = b""
            except TimeoutError:
                raise AssertionError(
                    f"a flood connection got neither an answer nor end-of-file in {timeout}s"
                ) from None
            if answer:
                connection.sendall(SETTINGS_ACK)
                self.kept.append(connection)
            else:
                self.closed.append(connection)


@contextmanager
def flood(path: Path, count: int, timeout: float = 10) -> Iterator[Flood]:
    """`count` idle HTTP/2 connections to the Unix socket `path`, all closed on exit."""
    with ExitStack() as stack:
        connections = []
        for _ in range(count):
            connection = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            connection.settimeout(timeout)
            connection.connect(str(path))
            # One closed at accept already refuses the bytes: `classify` reads end-of-file.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                connection.sendall(HTTP2_PREFACE + EMPTY_SETTINGS)
            connections.append(connection)
        yield Flood(connections)
