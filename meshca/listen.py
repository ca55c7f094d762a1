"""Listening addresses as operators write them (`HOST:PORT`, `[v6]:PORT`), checked once, and a
failure to listen said as one line naming the flag and what to do.

Dependency-free on purpose (`meshca.host_port` is too): the configuration modules of every
command import it.
"""

from __future__ import annotations

import errno
import socket

from meshca.host_port import split_host_port


class ListenError(Exception):
    """An address could not be listened on; the message names the flag and what to do."""


def parse_listen(flag: str, listen: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT`; port 0 picks a free one, no host is 127.0.0.1), or
    `ValueError` naming `flag` (`meshca.host_port` says what is wrong)."""
    try:
        host, port = split_host_port(listen)
    except ValueError as exc:
        raise ValueError(f"{flag} {listen!r}: {exc}") from None
    return host or "127.0.0.1", port


def listening_socket(listen: str, flag: str) -> socket.socket:
    """A bound, listening TCP socket for `listen`, or `ListenError` saying what to change."""
    try:
        host, port = parse_listen(flag, listen)
    except ValueError as exc:
        raise ListenError(str(exc)) from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ListenError(f"{flag} {listen}: cannot listen there: {_reason(exc)}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        hint = (
            "another process holds that port: stop it or pick another port"
            if exc.errno == errno.EADDRINUSE
            else "give an address of this host"
        )
        reason = _reason(exc)
        raise ListenError(f"{flag} {listen}: cannot listen there: {reason} ({hint})") from None
    return sock


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def check_can_listen(flag: str, listen: str) -> None:
    """Binds `listen` once and lets it go: a busy or foreign address is refused (`ListenError`)
    before a daemon writes or starts anything. The daemon binds again for real later, so a
    process that takes the port in between still fails, only later and less neatly."""
    listening_socket(listen, flag).close()
