"""One file followed by polling its status: the root file (`--ca-root`) of a CA-backed agent.

Why not watchdog (`agent.file_mounted.FileWatcher`): every pod agent follows exactly this one
file, and watchdog costs every pod its imports on the way to its first secret (about 7 ms
warm, several times that from a cold page cache), 1-2 MiB of resident memory and two more
threads (observer and inotify emitter). A `stat` of one file once a second costs about 50 µs
of CPU (the `stat` and the hop to a worker thread and back). watchdog stays where files are
watched on demand (`FILE_MOUNTED_CERTS`, `file-cert:`/`file-root:` names, any number of them,
reacting within 0.1 s), which a plain sidecar never loads.

What is compared (`FileSignature`), so each way the file is updated shows up:

- the kubelet's ConfigMap/Secret volume: a new hidden generation directory and an atomic swap
  of the `..data` symlink; the path then resolves into another directory (`target`), to
  another file (`inode`);
- a config tool writing a temporary file and renaming it over the old one: another `inode`;
- an in-place rewrite: `size`, `mtime_ns` and `ctime_ns` (the kernel sets `ctime` on every
  write, even when a tool such as `cp -p` restores `mtime` afterwards).

A change is read once the signature has stayed the same for `settle` seconds, so a rewrite
still in progress is not read half-written (and refused for nothing). As a backstop for
filesystems with coarse timestamps (two same-size writes within one tick look identical), the
content is re-read every `resync_interval` and reported when its bytes differ.

Concurrency: the poll is one asyncio task; every `stat` and read runs in a worker thread under
`read_timeout`, one at a time, so a hung mount (NFS, FUSE) holds one thread and never the loop
that serves SDS. Callbacks run on the loop. Reads go through `meshca.safe_read` (regular files
only, at most `max_bytes`).

A callback that raises does not end the poll: the file is someone else's to write, and whatever
its content makes a caller do wrong, the next version must still be read (a trust bundle put
right, a taint notice that names a real taint). The error is logged once, with its traceback,
per content (a version is handed over once, so the same bad content is not retried each poll).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from meshca.clock import Clock
from meshca.safe_read import DEFAULT_MAX_BYTES, UnsafeFileError, read_regular_file
from meshca.waiting import cancel_and_wait, result_within

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_SETTLE = 0.1
DEFAULT_RESYNC_INTERVAL = 60.0
DEFAULT_READ_TIMEOUT = 5.0

_T = TypeVar("_T")


@dataclass(frozen=True)
class FileSignature:
    """What a `stat` (following symlinks) says about a file; any difference means a change."""

    target: str  # the path with every symlink resolved
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileSignature | None:
        """The file's signature, or None when it cannot be stat'ed (missing, no permission)."""
        try:
            info = os.stat(path)
            target = os.path.realpath(path)
        except OSError:
            return None
        return cls(
            target, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns
        )


class FileStuck(Exception):
    """A `stat` or read of the file has not returned within the read timeout."""


class PolledFile:
    """Reads `path` at `start()` and again whenever it changes (see the module docstring).

    `on_change(data)` gets the bytes of each new version; `on_error(reason)` says why a version
    could not be read (missing, not a regular file, too large, stuck); the caller decides what
    a failure costs (the trust bundle counts it as refused and keeps what it serves).
    """

    def __init__(
        self,
        path: Path,
        clock: Clock,
        *,
        on_change: Callable[[bytes], Awaitable[None]],
        on_error: Callable[[str], None],
        interval: float = DEFAULT_POLL_INTERVAL,
        settle: float = DEFAULT_SETTLE,
        resync_interval: float = DEFAULT_RESYNC_INTERVAL,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if interval <= 0 or settle < 0 or resync_interval <= 0 or read_timeout <= 0:
            raise ValueError("poll interval, resync interval and read timeout must be positive")
        self.path = path
        self.clock = clock
        self.interval = interval
        self.settle = min(settle, interval)
        self.resync_interval = resync_interval
        self.read_timeout = read_timeout
        self.max_bytes = max_bytes
        self._on_change = on_change
        self._on_error = on_error
        self._read_signature: FileSignature | None = None  # at the last read
        self._read_data: bytes | None = None  # what the last successful read returned
        self._busy: asyncio.Future[Any] | None = None  # the worker-thread call in flight
        self._task: asyncio.Task[None] | None = None
        self.reads = 0

    async def start(self) -> None:
        """Reads the file once (so its content is handed over before this returns), then
        follows it. A file stuck at start is reported like a stuck poll, and followed."""
        try:
            signature = await self._signature()
        except FileStuck as exc:
            self._failed(str(exc))
        else:
            await self._read(signature)
        self._task = asyncio.create_task(self._poll_forever(), name=f"poll {self.path}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _poll_forever(self) -> None:
        seen = self._read_signature  # the signature at the previous look
        since_read = 0.0
        stuck = False
        while True:
            pause = self.settle if seen != self._read_signature else self.interval
            await self.clock.sleep(pause)
            since_read += pause
            try:
                current = await self._signature()
            except FileStuck as exc:
                if not stuck:  # said once, not at every poll while the mount hangs
                    self._failed(str(exc))
                stuck = True
                continue
            stuck = False
            if current != self._read_signature and current == seen:
                since_read = 0.0  # changed, then unchanged for `settle`: read that version
                await self._read(current)
            elif current == self._read_signature and since_read >= self.resync_interval:
                since_read = 0.0
                await self._read(current, resync=True)
            seen = current

    async def _read(self, signature: FileSignature | None, *, resync: bool = False) -> None:
        """Reads the file; hands a new content, or the reason it cannot be read, to the
        caller. Content equal to the last read's is not handed over again (a `touch`, a
        resync); neither is a failure a resync repeats."""
        self._read_signature = signature
        self.reads += 1
        try:
            data = await self._in_thread(read_regular_file, self.path, self.max_bytes)
        except (OSError, FileStuck) as exc:
            if not (resync and self._read_data is None):
                self._read_data = None
                self._failed(_reason(self.path, exc))
            return
        if data != self._read_data:
            self._read_data = data
            await self._changed(data)

    async def _changed(self, data: bytes) -> None:
        """`on_change(data)`. Whatever it raises is a bug of the caller's, not of the file:
        said once with its traceback (this content is not handed over again), and the file is
        still followed, its next version handed over as usual."""
        try:
            await self._on_change(data)
        except Exception:
            log.exception(
                "unexpected error taking in the new content of %s; still following the file",
                self.path,
            )

    def _failed(self, reason: str) -> None:
        """`on_error(reason)`, under the same rule as `_changed`."""
        try:
            self._on_error(reason)
        except Exception:
            log.exception(
                "unexpected error handling a failed read of %s (%s); still following the file",
                self.path,
                reason,
            )

    async def _signature(self) -> FileSignature | None:
        return await self._in_thread(FileSignature.of, self.path)

    async def _in_thread(self, call: Callable[..., _T], *args: object) -> _T:
        """`call(*args)` in a worker thread, at most one at a time, under `read_timeout`.

        A call that times out keeps its thread until the system call returns (Python cannot
        interrupt it); until then every new call fails with `FileStuck` at once rather than
        piling up threads on the stuck mount."""
        if self._busy is not None and not self._busy.done():
            raise FileStuck(
                f"a stat or read of {self.path} has not returned for over "
                f"{self.read_timeout:g}s (stuck filesystem?)"
            )
        busy: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(call, *args))
        self._busy = busy
        try:
            return cast(_T, await result_within(busy, self.read_timeout))
        except TimeoutError:
            raise FileStuck(
                f"a stat or read of {self.path} did not return within {self.read_timeout:g}s"
            ) from None


def _reason(path: Path, exc: BaseException) -> str:
    if isinstance(exc, (UnsafeFileError, FileStuck)):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"{path} does not exist"
    if isinstance(exc, OSError):
        return f"cannot read {path}: {exc.strerror or exc}"
    return str(exc)
