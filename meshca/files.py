"""Crash-safe file writes: a reader (or a restart after SIGKILL) sees the old file or the new
one, never half of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def ensure_dir(path: Path, mode: int = 0o700) -> Path:
    """Creates `path` (and parents) with `mode` if missing; an existing directory is accepted."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    return path


def atomic_write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Writes `data` to a temporary file beside `path`, fsyncs it, then renames it into place.

    The file is created with `mode` from the start, so a private key is never briefly readable.
    """
    payload = data.encode() if isinstance(data, str) else data
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Makes a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
