"""Crash-safe file writes: a reader (or a restart after SIGKILL) sees the old file or the new
one, never half of either.

`atomic_write` writes a temporary file beside its target (named `.<target>.<8 random>.tmp`,
`TEMPORARY_NAME`) and renames it into place. A process killed between the two leaves the
temporary file behind. Each writer holds an exclusive `flock` on its temporary file from just
after creating it until after the rename, and the kernel drops the lock when the process dies,
so `remove_abandoned_temporaries` can tell a leftover (nobody holds it) from a write in progress
in another process (locked) without guessing from its age.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

TEMPORARY_NAME = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp")
"""An `atomic_write` temporary file: `tempfile.mkstemp`'s 8 random characters between the
target's name and `.tmp`."""


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
    with _locked_temporary(path) as (fd, tmp_name):
        try:
            os.fchmod(fd, mode)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.replace(tmp_name, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
    fsync_dir(directory)


@contextlib.contextmanager
def _locked_temporary(path: Path) -> Iterator[tuple[int, str]]:
    """A new temporary file beside `path`, open and locked until the block ends. A sweep may
    take the lock between the file's creation and ours and remove it (it looked abandoned):
    then the file is created again, under a new name."""
    while True:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, tmp_name):
                yield fd, tmp_name
                return
        finally:
            os.close(fd)


def _same_file(fd: int, name: str) -> bool:
    """Whether `name` is still the file open as `fd` (not removed, not replaced)."""
    try:
        info = os.stat(name)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (info.st_dev, info.st_ino) == (mine.st_dev, mine.st_ino)


def remove_abandoned_temporaries(directory: Path) -> list[Path]:
    """Removes the `atomic_write` temporary files in `directory` (not below it) that no live
    process is writing: the leftovers of writers killed before their rename. Returns them.

    A temporary file being written is locked by its writer and skipped. Only names matching
    `TEMPORARY_NAME` are looked at; anything else in `directory` is left alone."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if TEMPORARY_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            path = Path(entry.path)
            if _remove_if_abandoned(path):
                removed.append(path)
    return removed


def _remove_if_abandoned(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # renamed into place meanwhile, or not a file we may open
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer holds it
        # Still the same file under that name (its writer may have renamed it into place just
        # before we locked): remove it while we hold the lock, so a writer that created it
        # and has not locked it yet sees it gone and starts over (`_locked_temporary`).
        if not _same_file(fd, str(path)):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Makes a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
