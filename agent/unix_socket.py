"""The agent's Unix sockets: one rule for claiming a path, serving on it and giving it back.

SDS (`agent.sds`), the pod agent's Workload API (`agent.workload.api`) and the node agent's
relay (`agent.workload.relay`) each serve on a path the operator names. `UnixSocketPath` is the one
place that decides what happens to that path:

- `prepare()`, before binding: the parent directory is created 0700 if missing; a path that
  exists and is not a socket is refused; a socket something answers on is refused (another
  agent's SDS socket, a SPIRE agent's Workload API socket: taking it over would leave its
  clients unable to reconnect, and nothing would say why); a socket the probe cannot judge
  (permission denied, no answer in time) is refused too. Only a dead socket, one where
  connecting is refused because its server exited without removing it, is removed, and that
  is logged. `prepare()` returns where to bind: a fresh name beside the path (`bind_path`).
- `claim(mode)`, once bound there: sets the mode, then links the socket in at the path, which
  never replaces anything (two agents starting at once on one path: the second is refused,
  rather than silently serving on a socket no client can reach), so the path never shows a
  socket with the wrong mode either; then remembers the socket's inode.
- `release()`, at stop: removes the path only while it is still that inode, so a successor
  that took the path over (after this process stopped serving, or while it was thought dead)
  keeps its socket. A start refused by `prepare()` has claimed nothing and removes nothing.

Why bind elsewhere and link: grpc removes the path it bound when its server stops, whoever's
socket the path holds by then; bound at `bind_path` (removed once linked), grpc finds nothing to
remove, and the removal is `release()`'s alone. A file system without hard links gets a rename
instead (which would replace a socket bound in the instant since `prepare()`).

Refusals are `agent.errors.SocketPathRefused` (a `FileExistsError`), whose message names the
path and what to do; `agent.main` prefixes the flag and exits with one line.

Connections: every socket the agent serves holds a bounded number. The gRPC servers (SDS, the
pod agent's Workload API) take `grpc_connection_cap(limit)` as server options: grpc's own
accept-level count (`grpc.max_allowed_incoming_connections`) closes a connection past the
limit as soon as it is accepted, while the open ones keep being served. The node relay counts
its own (`agent.workload.relay`), and the status port its own (`meshca.status_http`).

Concurrency: short blocking system calls (the liveness probe waits at most `PROBE_TIMEOUT`),
made on the event loop at start and stop only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import stat
from pathlib import Path

from agent.config import MAX_SOCKET_PATH_BYTES, SOCKET_BIND_NAME_BYTES, socket_path_bytes
from agent.errors import SocketPathRefused

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.5
DEFAULT_MAX_CONNECTIONS = 256
"""Connections one gRPC socket of the agent (SDS, a pod's Workload API) holds at once. An Envoy
holds one SDS connection, an application one per Workload API client (streams multiplex over
it), so 256 is far beyond what a pod needs; and the agent's sockets together (2 x 256, the
status port's 64) stay under the common 1024 file-descriptor soft limit, so a flood meets this
cap rather than the process running out of descriptors."""

_GRPC_CONNECTION_CAP = "grpc.max_allowed_incoming_connections"


def grpc_connection_cap(max_connections: int) -> list[tuple[str, int]]:
    """Options for `grpc.aio.server` that close each connection past `max_connections`
    (counted per listening socket) at accept; connections already open are not touched."""
    if max_connections < 1:
        raise ValueError(f"a connection cap must be at least 1, not {max_connections}")
    return [(_GRPC_CONNECTION_CAP, max_connections)]


class UnixSocketPath:
    """One server's claim on the Unix socket path `path`; `what` names the socket in log lines
    and refusals ("SDS socket"). See the module docstring for the rules."""

    def __init__(self, path: Path, what: str) -> None:
        if socket_path_bytes(path) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"{what} path {str(path)!r} is longer than {MAX_SOCKET_PATH_BYTES} bytes, the "
                "Unix socket limit (counting the name the agent binds beside it); choose a "
                "shorter path"
            )
        self.path = path
        self.what = what
        self.bind_path = _unused_name_beside(path)
        self._created: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound

    def prepare(self) -> Path:
        """Checks the path (see above) and returns `bind_path`, where to bind; raises
        `SocketPathRefused` leaving the path as it was."""
        if not self.path.parent.exists():
            self.path.parent.mkdir(mode=0o700, parents=True)
        while os.path.lexists(self.bind_path):  # grpc would remove a socket there: pick anew
            self.bind_path = _unused_name_beside(self.path)
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return self.bind_path
        if not stat.S_ISSOCK(mode):
            raise SocketPathRefused(
                f"{self.path} exists and is not a socket; refusing to replace it"
            )
        self._refuse_if_served()
        log.info("removing stale %s %s (nothing serves on it)", self.what, self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return self.bind_path

    def claim(self, mode: int) -> None:
        """Called once the server is bound to `bind_path`: sets `mode`, puts the socket at the
        path (never over anything there) and remembers its inode."""
        os.chmod(self.bind_path, mode)
        try:
            os.link(self.bind_path, self.path)
        except FileExistsError:
            raise SocketPathRefused(
                f"{self.path}: another process put a socket there while this agent was "
                f"starting; refusing to take it over: give the {self.what} a path of its own"
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP):
                raise
            os.rename(self.bind_path, self.path)  # no hard links on this file system
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.bind_path)
        status = os.lstat(self.path)
        self._created = (status.st_dev, status.st_ino)

    def release(self) -> None:
        """Removes the socket if the path still holds the one `claim` saw; else leaves it."""
        created, self._created = self._created, None
        if created is None:
            return
        try:
            status = os.lstat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return
        if (status.st_dev, status.st_ino) != created:
            log.info("%s %s is now another process's; leaving it", self.what, self.path)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _refuse_if_served(self) -> None:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(PROBE_TIMEOUT)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            return  # dead (or removed meanwhile): ours to take
        except OSError as exc:  # permission denied, a full backlog's timeout: not ours to judge
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise SocketPathRefused(
                f"{self.path} is a socket this agent cannot probe ({reason}); refusing to "
                f"replace it: remove it if nothing serves there, or give the {self.what} a "
                "path of its own"
            ) from None
        finally:
            probe.close()
        raise SocketPathRefused(
            f"{self.path} is a socket another process is serving on (another meshca agent? a "
            "SPIRE agent?); refusing to take it over: stop that process, or give the "
            f"{self.what} a path of its own"
        )


def _unused_name_beside(path: Path) -> Path:
    """A hidden name in `path`'s directory (a rename stays in one file system), random so that
    no other process binds it."""
    digits = secrets.token_hex(SOCKET_BIND_NAME_BYTES)[: SOCKET_BIND_NAME_BYTES - 1]
    return path.parent / f".{digits}"
