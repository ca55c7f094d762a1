"""Holding the process at the other end of a Unix socket: the pidfd the kernel hands out for it
(or, on a kernel without `SO_PEERPIDFD`, none: the start-time way), the boot clock of the
accept, and `/proc/<pid>/stat`'s start time, read past a command name made to mislead."""

from __future__ import annotations

import os
import socket

import pytest

from agent.workload.peer_process import has_exited, start_ticks_in_stat, take_peer_process
from tests.support.fake_proc import NO_SUCH_OPTION, boot_ns, kernel_has_peer_pidfd, stat_text


@pytest.mark.parametrize(
    "comm", ["python3", "a b", "x) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 (y", ")"]
)
def test_the_start_time_is_counted_from_the_last_parenthesis(comm: str) -> None:
    assert start_ticks_in_stat(stat_text(42, 123456, comm).encode()) == 123456


@pytest.mark.parametrize(
    "text",
    [b"", b"42 (python3) S 1 2 3", b"42 python3 S" + b" 0" * 60, b"42 (p) S" + b" -1" * 60],
)
def test_a_stat_without_a_start_time_has_none(text: bytes) -> None:
    assert start_ticks_in_stat(text) is None


def test_this_process_started_before_now_on_the_boot_clock() -> None:
    """The two clocks the start-time way compares are one: `starttime` counts the boot clock."""
    with open(f"/proc/{os.getpid()}/stat", "rb") as stat:
        started = start_ticks_in_stat(stat.read())
    assert started is not None
    assert started < boot_ns() * os.sysconf("SC_CLK_TCK") // 1_000_000_000


def test_without_the_pidfd_option_the_peer_is_held_by_its_credentials() -> None:
    """A socket option the kernel does not know (as `SO_PEERPIDFD` before Linux 6.5): no
    pidfd, and the credentials and accept time still taken."""
    before = boot_ns()
    one, other = socket.socketpair()
    with one, other:
        held = take_peer_process(one, pidfd_option=NO_SUCH_OPTION)
    assert held.pidfd is None
    assert held.credentials.pid == os.getpid() and held.credentials.uid == os.getuid()
    assert before <= held.accepted_ns <= boot_ns()
    held.close()


@pytest.mark.skipif(
    not kernel_has_peer_pidfd(), reason="this kernel has no SO_PEERPIDFD (Linux 6.5+)"
)
def test_the_kernel_hands_out_a_pidfd_on_the_peer_itself() -> None:
    one, other = socket.socketpair()
    with one, other:
        held = take_peer_process(one)
    assert held.pidfd is not None
    try:
        with open(f"/proc/self/fdinfo/{held.pidfd}") as info:
            assert f"Pid:\t{os.getpid()}\n" in info.read()
        assert not has_exited(held.pidfd)
    finally:
        held.close()
