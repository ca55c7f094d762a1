"""`bench.proc_memory`: the smaps breakdown that `bench/agent_footprint.py` prints must put each
mapping in the right group and split anonymous from file-backed pages as the kernel counts them,
or the bench would send whoever cuts memory after the wrong part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.proc_memory import (
    ANONYMOUS,
    GROUP_NAMES,
    OTHER,
    memory_by_mapping,
    parse_smaps,
    status_mib,
    total,
)

SITE = "/venv/lib/python3.11/site-packages"


def mapping(header: str, rss_kib: int, anon_kib: int) -> str:
    """One mapping as `/proc/PID/smaps` shows it (the fields the parser does not read kept, so
    it is shown to skip them)."""
    return (
        f"{header}\n"
        f"Size:               {rss_kib * 2} kB\n"
        f"Rss:                {rss_kib} kB\n"
        f"Pss:                {rss_kib} kB\n"
        f"Anonymous:          {anon_kib} kB\n"
        "THPeligible:    0\n"
        "VmFlags: rd ex mr mw me\n"
    )


def test_mappings_are_grouped_by_what_they_map_and_split_into_anonymous_and_file() -> None:
    text = "".join(
        [
            mapping(f"7f00-7f10 r-xp 00000 08:01 11 {SITE}/grpc/_cython/cygrpc.so", 8192, 0),
            mapping(f"7f10-7f20 rw-p 00100 08:01 11 {SITE}/grpc/_cython/cygrpc.so", 300, 200),
            mapping(f"7f20-7f30 r-xp 00000 08:01 12 {SITE}/cryptography/_rust.abi3.so", 4096, 0),
            mapping("7f30-7f40 r-xp 00000 08:01 13 /usr/lib/libcrypto.so.3", 2048, 0),
            mapping("7f40-7f50 r-xp 00000 08:01 14 /usr/lib/x86_64-linux-gnu/libc.so.6", 1024, 0),
            mapping("7f50-7f60 r-xp 00000 08:01 15 /usr/lib/python3.11/_json.so", 64, 0),
            mapping("5600-5700 rw-p 00000 00:00 0                  [heap]", 5000, 5000),
            mapping("7f60-7f70 rw-p 00000 00:00 0 ", 3000, 3000),
            mapping("7ffc-7ffd rw-p 00000 00:00 0                  [stack]", 100, 100),
            mapping("7ffe-7fff r-xp 00000 00:00 0                  [vdso]", 8, 0),
        ]
    )
    groups = parse_smaps(text)
    assert set(groups) == set(GROUP_NAMES)
    grpc = groups["grpc (cygrpc, BoringSSL inside)"]
    assert (grpc.anon_mib, grpc.file_mib) == (200 / 1024, (8192 + 100) / 1024)
    assert groups["cryptography (_rust: OpenSSL inside)"].file_mib == 4
    assert groups["system OpenSSL (Python's ssl)"].file_mib == 2
    assert groups["C/C++ runtime (libc, libstdc++...)"].file_mib == 1
    assert groups["other native libraries"].file_mib == 64 / 1024
    assert groups["[heap]: malloc's main arena"].anon_mib == 5000 / 1024
    assert groups[ANONYMOUS].anon_mib == 3100 / 1024  # anonymous mmaps and the stack
    assert groups[OTHER].file_mib == 8 / 1024
    assert groups["protobuf (upb)"].anon_mib == groups["protobuf (upb)"].file_mib == 0
    everything = total(groups)
    assert everything.anon_mib == (200 + 5000 + 3100) / 1024
    assert (
        everything.anon_mib + everything.file_mib
        == (8192 + 300 + 4096 + 2048 + 1024 + 64 + 5000 + 3000 + 100 + 8) / 1024
    )


@pytest.mark.process
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc only")
def test_a_live_process_breakdown_adds_up_to_what_the_kernel_reports() -> None:
    """On a live Python process: the groups sum to its RSS and anonymous RSS, and its
    interpreter shows up where expected. The process is a quiet child, not this one: a test
    process under pytest-xdist has threads allocating between the two reads."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import json, socket, sys; print(flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()  # its imports are done
        groups = memory_by_mapping(child.pid)
        rss, anon, _ = status_mib(child.pid)
    finally:
        child.communicate(b"")
    everything = total(groups)
    assert everything.anon_mib == pytest.approx(anon, abs=0.5)
    assert everything.anon_mib + everything.file_mib == pytest.approx(rss, abs=0.5)
    assert groups[ANONYMOUS].anon_mib > 0  # Python's object arenas
    assert groups["other native libraries"].file_mib > 0  # e.g. _json, _socket
