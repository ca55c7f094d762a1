"""Reading small files named by someone else (an SDS client, an operator's flag) without letting
the file decide how long the read takes or how much memory it costs.

`open()` on a FIFO blocks until a writer appears, a character device such as `/dev/zero` never
ends, and a huge file costs memory; on an asyncio loop any of them stalls every other client.
`read_regular_file` opens without blocking (`O_NONBLOCK`; symlinks are followed, as the
kubelet's `..data` layout needs), refuses anything `fstat` does not call a regular file, and
reads at most `max_bytes`.

Concurrency: `read_regular_file` blocks its caller, so callers on an event loop run it in a
worker thread under a time limit (`meshca.waiting.result_within`: `agent.polled_file`,
`agent.file_mounted`, `ca_server.jwt_authn`), for a stuck filesystem (NFS, FUSE) where even a
regular file's read can hang. A timed-out read leaves its thread to finish on its own: Python
cannot interrupt a blocked system call, but the loop is no longer waiting for it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_MAX_BYTES = 1024 * 1024


class UnsafeFileError(OSError):
    """The path names something that is not a small regular file; the message names the path
    and the problem, never the content."""


def read_regular_file(path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The file's bytes; `OSError` if it cannot be opened, `UnsafeFileError` if it is not a
    regular file or is larger than `max_bytes`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{path} is not a regular file ({_kind(info.st_mode)})")
        if info.st_size > max_bytes:
            raise UnsafeFileError(f"{path} is {info.st_size} bytes; the limit is {max_bytes}")
        chunks: list[bytes] = []
        remaining = max_bytes + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 64 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while being read
        raise UnsafeFileError(f"{path} is larger than the limit of {max_bytes} bytes")
    return data


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "a special file"


def path_is_within(path: Path, directories: tuple[Path, ...]) -> bool:
    """True if `path`, with symlinks and `..` resolved, lies inside one of `directories`
    (also resolved). Resolving first defeats `allowed/../../etc/shadow` and a symlink planted
    in an allowed directory that points out of it."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(directory.resolve()) for directory in directories)
