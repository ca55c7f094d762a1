"""A `/proc` that tests write, for the node agent's attestor
(`agent.workload.peer_process.CallerProc` reads `<pid>/cgroup` and `<pid>/stat` below any root).

`file_process` files a pid: its cgroup text, and its stat either written (`stat_text`, with the
start time the test chooses) or linked to the real `/proc/<pid>/stat` of a real process (so the
attestor sees that process's real start time, and nothing once it has been reaped).

How the relay holds a caller is chosen with the socket option it asks for the pidfd:
`SO_PEERPIDFD`, where `kernel_has_peer_pidfd()`, or `NO_SUCH_OPTION`, which every kernel
answers `ENOPROTOOPT`: the start-time way, as on a kernel before 6.5.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from agent.workload.peer_process import PeerCredentials, PeerProcess, take_peer_process

NO_SUCH_OPTION = 0x7FFF  # no SOL_SOCKET option has this number
STAT_FIELDS = 52  # what Linux 6.x writes; the attestor reads field 22 (starttime)


def stat_text(pid: int, start_ticks: int, comm: str = "python3") -> str:
    """A `/proc/<pid>/stat` line for a sleeping process started `start_ticks` after boot."""
    after_comm = ["0"] * (STAT_FIELDS - 2)
    after_comm[0] = "S"
    after_comm[22 - 3] = str(start_ticks)
    return f"{pid} ({comm}) {' '.join(after_comm)}\n"


def file_process(
    proc_root: Path,
    pid: int | str,
    cgroup: str,
    *,
    start_ticks: int | None = None,
    stat_of: int | None = None,
) -> None:
    """Files `pid` under `proc_root` with `cgroup`; its stat is `stat_text(start_ticks)`, or
    (None) a link to the real `/proc/<stat_of or pid>/stat`. Filing a pid again replaces what
    was filed."""
    directory = proc_root / str(pid)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup").write_text(cgroup)
    stat = directory / "stat"
    stat.unlink(missing_ok=True)
    if start_ticks is None:
        stat.symlink_to(f"/proc/{stat_of or pid}/stat")
    else:
        stat.write_text(stat_text(int(pid), start_ticks))


def boot_ns() -> int:
    """The boot clock now, the one the relay reads at accept (`CLOCK_BOOTTIME`)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def caller(pid: int, accepted_ns: int | None = None, pidfd: int | None = None) -> PeerProcess:
    """A connecting process as the relay would hand it over (accepted now unless told)."""
    accepted = boot_ns() if accepted_ns is None else accepted_ns
    return PeerProcess(PeerCredentials(pid, 0, 0), accepted, pidfd)


def kernel_has_peer_pidfd() -> bool:
    """Whether this kernel hands out a pidfd for a Unix socket's peer (Linux 6.5+)."""
    one, other = socket.socketpair()
    with one, other:
        held = take_peer_process(one)
        held.close()
        return held.pidfd is not None
