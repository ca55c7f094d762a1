"""Resident memory of a live process, from /proc (Linux), for the benchmarks: the totals, and
where they are, mapping by mapping.

VmRSS alone cannot say what to cut. `/proc/PID/smaps` can: each mapping names what it maps (a
library, `[heap]`, or nothing for an anonymous `mmap`) and how much of it is resident, and of
that how much is anonymous (the process's own pages: heap, Python's object arenas, a library's
relocated data) rather than file-backed (library code and read-only data, shared through the
page cache with every process mapping the same file, and reclaimable). `MAPPING_GROUPS` folds
the few hundred mappings of a Python gRPC agent into the parts one would act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_KIB_PER_MIB = 1024


@dataclass(frozen=True)
class Resident:
    """Resident memory of one group of mappings, in MiB."""

    anon_mib: float
    file_mib: float


# (group, substrings of the mapped path): a mapping joins the first group one of whose substrings
# its path contains. Mappings with no path (anonymous `mmap`s) and `[stack]` join ANONYMOUS.
MAPPING_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grpc (cygrpc, BoringSSL inside)", ("/grpc/_cython/",)),
    ("cryptography (_rust: OpenSSL inside)", ("/cryptography/", "_cffi_backend")),
    ("protobuf (upb)", ("/google/_upb/",)),
    ("libpython", ("libpython",)),
    ("system OpenSSL (Python's ssl)", ("libcrypto.so", "libssl.so", "/_ssl.", "/_hashlib.")),
    ("C/C++ runtime (libc, libstdc++...)", ("libc.so", "libm.so", "libstdc++", "libgcc_s", "ld-")),
    ("other native libraries", (".so",)),
    ("[heap]: malloc's main arena", ("[heap]",)),
)  # fmt: skip
ANONYMOUS = "anonymous mmaps: Python's arenas, threads"
OTHER = "other mappings"
GROUP_NAMES: tuple[str, ...] = (*(name for name, _ in MAPPING_GROUPS), ANONYMOUS, OTHER)


def group_of(path: str) -> str:
    """The `GROUP_NAMES` entry a mapping of `path` (`""` for an anonymous one) belongs to."""
    if path in ("", "[stack]") or path.startswith(("[stack:", "[anon:")):
        return ANONYMOUS
    for name, needles in MAPPING_GROUPS:
        if any(needle in path for needle in needles):
            return name
    return OTHER


def parse_smaps(text: str) -> dict[str, Resident]:
    """Resident memory per group (every `GROUP_NAMES` entry, zero when absent) of a process
    whose `/proc/PID/smaps` is `text`. File-backed is `Rss - Anonymous`: the kernel counts a
    library's written (copy-on-write) pages as anonymous, though the mapping names the file."""
    rss_kib = dict.fromkeys(GROUP_NAMES, 0)
    anon_kib = dict.fromkeys(GROUP_NAMES, 0)
    group = OTHER
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping: "start-end perms offset dev inode [path]"
            group = group_of(fields[5] if len(fields) > 5 else "")
        elif fields[0] == "Rss:":
            rss_kib[group] += int(fields[1])
        elif fields[0] == "Anonymous:":
            anon_kib[group] += int(fields[1])
    return {
        name: Resident(
            anon_kib[name] / _KIB_PER_MIB, (rss_kib[name] - anon_kib[name]) / _KIB_PER_MIB
        )
        for name in GROUP_NAMES
    }


def memory_by_mapping(pid: int) -> dict[str, Resident]:
    """Resident memory of a live process per `GROUP_NAMES` entry."""
    return parse_smaps(Path(f"/proc/{pid}/smaps").read_text())


def status_mib(pid: int) -> tuple[float, float, float]:
    """(VmRSS, RssAnon, VmHWM) of a live process, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()

    def mib(key: str) -> float:
        return int(fields[key].split()[0]) / _KIB_PER_MIB

    return mib("VmRSS"), mib("RssAnon"), mib("VmHWM")


def pss_mib(pid: int) -> float:
    """Proportional set size of a live process, in MiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / _KIB_PER_MIB
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def total(groups: Mapping[str, Resident]) -> Resident:
    return Resident(
        sum(each.anon_mib for each in groups.values()),
        sum(each.file_mib for each in groups.values()),
    )
