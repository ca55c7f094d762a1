"""CPU time of a process and all its descendants, from /proc (Linux), for the benchmarks.

A `meshca ca --workers N` supervisor does little itself: its workers are its children, so the
CA's cost is the sum over the tree. Descendants that already exited are not counted; the
benchmarks keep their servers alive for the whole measurement.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and its living descendants (parents before children)."""
    found = [pid]
    for parent in found:
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found.extend(int(child) for child in children)
    return found


def own_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` itself (not its children), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its living descendants."""
    return sum(own_cpu_seconds(each) or 0.0 for each in process_tree(pid))
