"""The node agent's Workload API socket: takes each caller's peer credentials, then relays.

grpc does not tell a Python servicer who is at the other end of a Unix socket (no `SO_PEERCRED`
in its auth context). So in node mode the public socket is this relay's: it accepts a
connection, takes the connecting process from the kernel (`SO_PEERCRED`, and a pidfd where the
kernel has `SO_PEERPIDFD`: `agent.workload.peer_process`) and hands it to `inspect` at once
(`agent.workload.attestor`: the caller's pod UID from its cgroup, proven to be the caller's and
not a later holder of its pid), then opens a connection of its own to the gRPC server's private
socket from a socket bound to a fresh abstract name, and copies bytes both ways. The servicer
sees that name as `context.peer()` (`unix-abstract:<name>`) and asks `accepted(peer)` what was
learned at accept time. A name carries a random 128-bit token, so no other process can present
one, and the private socket sits in a 0700 directory of the agent's own (never in the volume
shared with workloads); a connection that reaches it any other way has no record and is refused
by `agent.workload.attestor.NodeCaller`.

Concurrency: all on the agent's event loop (asyncio streams), two copy tasks per connection;
the record of a connection lives exactly as long as the connection. At most `max_connections`
at once, and `max_connections_per_caller` for one placed caller: a connection past either is
closed at once (and logged), the others keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from agent.errors import CallerNotAttested
from agent.unix_socket import UnixSocketPath
from agent.workload.peer_process import (
    NO_PEER,
    SO_PEERPIDFD,
    Accepted,
    PeerProcess,
    take_peer_process,
)

log = logging.getLogger(__name__)

ABSTRACT_PREFIX = "unix-abstract:"
DEFAULT_MAX_CONNECTIONS = 4096
_CHUNK = 64 * 1024


class PeerRelay:
    """Public socket `public_path` (mode `socket_mode`) → private gRPC socket (see above)."""

    # The socket option that yields the caller's pidfd; tests set one the kernel does not know
    # to take the start-time way (`agent.workload.peer_process`) on any kernel.
    pidfd_option = SO_PEERPIDFD

    def __init__(
        self,
        public_path: Path,
        inspect: Callable[[PeerProcess], str],
        *,
        socket_mode: int = 0o600,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_caller: int | None = None,
    ) -> None:
        self.public_path = public_path
        self._public_socket = UnixSocketPath(public_path, "Workload API socket")
        self._inspect = inspect
        self.socket_mode = socket_mode
        self.max_connections = max_connections
        # Keyed by what `inspect` placed the caller as (unplaced callers share one key), so
        # one pod, or a flood of callers in no pod, cannot take every connection slot.
        self.max_connections_per_caller = max_connections_per_caller
        self._connections_of: dict[str | None, int] = {}
        self._private_dir = Path(tempfile.mkdtemp(prefix="meshca-wapi-"))
        self.private_path = self._private_dir / "grpc.sock"
        self._token = secrets.token_hex(16)
        self._numbers = itertools.count(1)
        self._accepted: dict[str, Accepted] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None

    @property
    def grpc_address(self) -> str:
        return f"unix:{self.private_path}"

    @property
    def connections(self) -> int:
        return len(self._accepted)

    def accepted(self, peer: str) -> Accepted | None:
        """The record of the relayed connection grpc names `peer`, if it is one of ours."""
        if not peer.startswith(ABSTRACT_PREFIX):
            return None
        return self._accepted.get(peer[len(ABSTRACT_PREFIX) :])

    async def start(self) -> None:
        bind_path = self._public_socket.prepare()
        self._server = await asyncio.start_unix_server(self._on_connection, str(bind_path))
        self._public_socket.claim(self.socket_mode)

    async def stop(self) -> None:
        """Ends every relayed connection; removes the public socket if it is still the one this
        relay bound (`agent.unix_socket`: one another process serves on, or took over since,
        is never removed) and the private directory."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._public_socket.release()
        shutil.rmtree(self._private_dir, ignore_errors=True)

    def _learn(self, client: socket.socket | None) -> Accepted:
        try:
            if client is None:
                raise CallerNotAttested(NO_PEER, "the connection carries no socket to inspect")
            caller = take_peer_process(client, pidfd_option=self.pidfd_option)
        except (OSError, CallerNotAttested) as exc:
            refusal = (
                exc
                if isinstance(exc, CallerNotAttested)
                else CallerNotAttested(NO_PEER, f"no peer credentials for the caller: {exc}")
            )
            return Accepted(None, None, refusal)
        try:
            return Accepted(caller.credentials, self._inspect(caller), None)
        except CallerNotAttested as exc:
            return Accepted(caller.credentials, None, exc)
        finally:
            caller.close()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        name = f"meshca-wapi-{self._token}-{next(self._numbers)}"
        try:
            if len(self._accepted) >= self.max_connections:
                log.warning(
                    "Workload API: %d connections open, the limit; closing a new one",
                    self.max_connections,
                )
                return
            record = self._learn(writer.get_extra_info("socket"))
            held = self._connections_of.get(record.placed, 0)
            if (
                self.max_connections_per_caller is not None
                and held >= self.max_connections_per_caller
            ):
                log.warning(
                    "Workload API: caller %s already holds %d connections, the most one caller "
                    "may; closing a new one",
                    record.placed or "(not placed)",
                    held,
                )
                return
            self._connections_of[record.placed] = held + 1
            self._accepted[name] = record
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.bind("\0" + name)
                upstream.setblocking(False)
                await asyncio.get_running_loop().sock_connect(upstream, str(self.private_path))
            except OSError:
                upstream.close()
                raise
            up_reader, up_writer = await asyncio.open_unix_connection(sock=upstream)
            try:
                await _pump_both(reader, writer, up_reader, up_writer)
            finally:
                up_writer.close()
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.debug("Workload API relay connection %s ended: %s", name, exc)
        finally:
            ended = self._accepted.pop(name, None)
            if ended is not None:
                remaining = self._connections_of[ended.placed] - 1
                if remaining:
                    self._connections_of[ended.placed] = remaining
                else:
                    del self._connections_of[ended.placed]
            writer.close()
            if task is not None:
                self._tasks.discard(task)


async def _pump_both(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copies a→b and b→a until either side ends, then ends both."""
    pumps = [
        asyncio.create_task(_pump(a_reader, b_writer)),
        asyncio.create_task(_pump(b_reader, a_writer)),
    ]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
