"""The process at the other end of a Unix socket, held by more than its pid number.

The kernel's peer credentials (`SO_PEERCRED`) name the process that connected by its pid, and a
pid is only a number: once that process exits, the kernel may hand the number to any new
process, in any pod. What `agent.workload.attestor` reads in `/proc/<pid>/` therefore counts
only when it is proven to be the connecting process's, and `CallerProc.read` proves it in one
of two ways, whichever the kernel offers for the connection (`take_peer_process`, at accept):

- **pidfd** (`SO_PEERPIDFD`, Linux 6.5+): a handle on the connecting process itself, which no
  other process can take over. A pid is not given out again while its process lives, so a read
  followed by a pidfd that still says "running" was the caller's read. Exact; an exited caller
  is refused even if nothing has taken its pid yet.
- **start time**, where the kernel lacks `SO_PEERPIDFD` (`ENOPROTOOPT`): `/proc/<pid>/stat`'s
  `starttime` (field 22, clock ticks since boot) is read before and after the file. A process
  that takes over an exited caller's pid starts after the caller exited, so: the process must
  have started before the connection was accepted (the boot clock, `CLOCK_BOOTTIME`, is read
  at accept: the clock `starttime` counts on), which refuses a pid taken after the accept,
  and its start time must be the same after the file was read, which refuses one taken during
  the read. A tick is 1/`SC_CLK_TCK` s (10 ms): a process whose start tick is the
  accept's own cannot be told from one that started just after the accept and is refused (it
  is placed when it connects again). What this way cannot see is a caller that exited, and
  had its pid taken, between its `connect` and the accept (its wait in the listen backlog);
  the pidfd sees that too.

Anything that cannot be placed with certainty is refused (`CallerNotAttested`, reason below).

Injectable: `proc_root` (tests hand in a directory of `<pid>/cgroup` and `<pid>/stat` files)
and the socket option that yields the pidfd (`take_peer_process(pidfd_option=...)`: an option
the kernel does not know forces the start-time way on any kernel).

Concurrency: `take_peer_process` and `CallerProc.read` are a few non-blocking system calls and
reads of procfs files (which never wait on a disk); they run on the event loop at accept time.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from agent.errors import CallerNotAttested

NO_PEER = "no_peer_credentials"
UNREADABLE = "process_unreadable"
CALLER_EXITED = "caller_exited"
PID_REUSED = "pid_reused"

# Python 3.11's `socket` has no name for it; 77 in asm-generic/socket.h (x86, arm64, ...).
SO_PEERPIDFD: int = getattr(socket, "SO_PEERPIDFD", 77)
_UCRED = struct.Struct("3i")
_STARTTIME_AFTER_COMM = 22 - 3  # field 22, counted from field 3 (the first after `(comm)`)
MAX_STAT_BYTES = 4096


@dataclass(frozen=True)
class PeerCredentials:
    """What the kernel says about the process at the other end of a Unix socket."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class PeerProcess:
    """The connecting process as held at accept: its credentials, the boot clock at the accept
    (`accepted_ns`, `CLOCK_BOOTTIME` nanoseconds) and, where the kernel has `SO_PEERPIDFD`, a
    pidfd on it. The pidfd is open until `close()`: the relay closes it once the connection
    is inspected, so a connection holds no file descriptor for it afterwards."""

    credentials: PeerCredentials
    accepted_ns: int
    pidfd: int | None = None

    @property
    def pid(self) -> int:
        return self.credentials.pid

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)


@dataclass(frozen=True)
class Accepted:
    """What the relay (`agent.workload.relay`) learned about one connection when it was
    accepted: its credentials and the result of its `inspect` (a value, or the refusal to give
    on every call it makes); what `agent.workload.attestor.NodeCaller` answers from."""

    peer: PeerCredentials | None
    placed: str | None
    refusal: CallerNotAttested | None


def take_peer_process(sock: socket.socket, *, pidfd_option: int = SO_PEERPIDFD) -> PeerProcess:
    """The process that connected `sock`: the boot clock first (so the accept is no later than
    it), then `SO_PEERCRED` and `pidfd_option`'s pidfd (None where the kernel lacks it).
    `CallerNotAttested` if the kernel has no process for the connection any more."""
    accepted_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    try:
        pidfd: int | None = sock.getsockopt(socket.SOL_SOCKET, pidfd_option)
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:  # a kernel before 6.5: the start-time way
            pidfd = None
        elif exc.errno in (errno.ESRCH, errno.EINVAL):  # what kernels 6.5-6.15 say of one gone
            raise CallerNotAttested(
                CALLER_EXITED,
                f"the caller (pid {pid}) exited before the node agent could inspect it "
                f"({exc.strerror}); its pid may already be another process's, so it is not "
                "placed",
            ) from None
        else:
            raise
    return PeerProcess(PeerCredentials(pid, uid, gid), accepted_ns, pidfd)


def has_exited(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has exited (a pidfd polls readable from then on;
    poll, not select: a busy agent's descriptors pass select's limit of 1024)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def start_ticks_in_stat(text: bytes) -> int | None:
    """`starttime` (field 22) of a `/proc/<pid>/stat` text, or None if it has none. The
    command name (field 2, in parentheses) may itself hold spaces and parentheses, so the
    fields are counted from the last `)`."""
    _, closing, rest = text.rpartition(b")")
    fields = rest.split()
    if not closing or len(fields) <= _STARTTIME_AFTER_COMM:
        return None
    value = fields[_STARTTIME_AFTER_COMM]
    return int(value) if value.isdigit() else None


class CallerProc:
    """Reads a connecting process's files below `proc_root` (normally `/proc`), each proven
    to be that process's (the two ways above)."""

    def __init__(
        self, proc_root: Path = Path("/proc"), ticks_per_second: int | None = None
    ) -> None:
        self.proc_root = proc_root
        self.ticks_per_second = ticks_per_second or os.sysconf("SC_CLK_TCK")

    def read(self, caller: PeerProcess, name: str, limit: int) -> bytes:
        """The first `limit` bytes of `/proc/<pid>/<name>` of `caller`; `CallerNotAttested`
        if it cannot be read or cannot be proven to be the caller's."""
        if caller.pid <= 0:
            raise CallerNotAttested(NO_PEER, "the kernel reported no process for this caller")
        started = None if caller.pidfd is not None else self._started_before_accept(caller)
        data = self._read(caller.pid, name, limit)
        if caller.pidfd is not None:
            if has_exited(caller.pidfd):
                raise CallerNotAttested(
                    CALLER_EXITED,
                    f"the caller (pid {caller.pid}) exited before the node agent finished "
                    "inspecting it; its pid may already be another process's, so it is not "
                    "placed",
                )
        elif self._start_ticks(caller.pid) != started:
            raise CallerNotAttested(
                PID_REUSED,
                f"the process at pid {caller.pid} changed while the node agent inspected it "
                "(the caller exited and its pid was taken); it is not placed",
            )
        return data

    def _started_before_accept(self, caller: PeerProcess) -> int:
        started = self._start_ticks(caller.pid)
        accept_tick = caller.accepted_ns * self.ticks_per_second // 1_000_000_000
        if started > accept_tick:
            raise CallerNotAttested(
                PID_REUSED,
                f"the process at pid {caller.pid} started after the connection was accepted, "
                "so it is not the caller: the caller exited and its pid was taken by another "
                "process; it is not placed",
            )
        if started == accept_tick:
            raise CallerNotAttested(
                PID_REUSED,
                f"the process at pid {caller.pid} started within the clock tick its connection "
                f"was accepted in (1/{self.ticks_per_second} s), too close to tell it from a "
                "process that took an exited caller's pid; it is not placed (connect again; "
                "on Linux 6.5+ the kernel's SO_PEERPIDFD makes this exact)",
            )
        return started

    def _start_ticks(self, pid: int) -> int:
        started = start_ticks_in_stat(self._read(pid, "stat", MAX_STAT_BYTES))
        if started is None:
            raise CallerNotAttested(
                UNREADABLE, f"the caller's {self.proc_root / str(pid) / 'stat'} has no start time"
            )
        return started

    def _read(self, pid: int, name: str, limit: int) -> bytes:
        path = self.proc_root / str(pid) / name
        try:
            with path.open("rb") as handle:
                return handle.read(limit)
        except OSError as exc:
            raise CallerNotAttested(
                UNREADABLE,
                f"the caller (pid {pid}) cannot be inspected ({path}: {exc.strerror}): it has "
                "exited, or the node agent does not see its PID namespace; the node agent "
                "needs the host's PID namespace (hostPID: true) to see its callers",
            ) from None
