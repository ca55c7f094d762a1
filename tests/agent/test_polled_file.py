"""`agent.polled_file`: one file followed by `stat` polling sees each way a file is updated.

Real files in a short temporary directory, the real clock with short intervals. The three update
styles are the kubelet's (`..data` symlink swap), an in-place rewrite (same size, so only the
timestamps and ctime differ) and a rename over the file; a `touch` and an unreadable file are
the cases that must not be reported as new content.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from agent import polled_file
from agent.polled_file import DEFAULT_RESYNC_INTERVAL, FileSignature, PolledFile
from meshca.clock import SystemClock
from meshca.safe_read import read_regular_file
from tests.support.agent_wiring import until
from tests.support.kubelet_volume import kubelet_update


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="pf-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Follower:
    """Records what a `PolledFile` hands over."""

    def __init__(self) -> None:
        self.contents: list[bytes] = []
        self.errors: list[str] = []

    async def changed(self, data: bytes) -> None:
        self.contents.append(data)

    def failed(self, reason: str) -> None:
        self.errors.append(reason)


def follow(
    path: Path,
    scenario: Callable[[PolledFile, Follower], Awaitable[None]],
    follower: Follower | None = None,
    resync_interval: float = DEFAULT_RESYNC_INTERVAL,
) -> Follower:
    """Runs `scenario` while `path` is followed (polled every 20 ms, settling for 10 ms, read
    again whole every `resync_interval`) by `follower` (a new `Follower` unless one is given)."""
    follower = follower or Follower()

    async def main() -> None:
        polled = PolledFile(
            path,
            SystemClock(),
            on_change=follower.changed,
            on_error=follower.failed,
            interval=0.02,
            settle=0.01,
            resync_interval=resync_interval,
        )
        await polled.start()
        try:
            await scenario(polled, follower)
        finally:
            await polled.stop()

    asyncio.run(main())
    return follower


def test_the_kubelet_symlink_swap_is_seen(workdir: Path) -> None:
    mount = workdir / "mount"
    kubelet_update(mount, "root-cert.pem", "first\n")

    async def scenario(_: PolledFile, follower: Follower) -> None:
        assert follower.contents == [b"first\n"]  # read before start() returned
        kubelet_update(mount, "root-cert.pem", "second\n")  # same size, another generation
        await until(lambda: len(follower.contents) == 2, timeout=5)

    follower = follow(mount / "root-cert.pem", scenario)
    assert follower.contents == [b"first\n", b"second\n"]
    assert follower.errors == []


def test_an_in_place_rewrite_of_the_same_size_is_seen(workdir: Path) -> None:
    path = workdir / "root-cert.pem"
    path.write_bytes(b"A" * 64)
    inode = path.stat().st_ino

    async def scenario(_: PolledFile, follower: Follower) -> None:
        with path.open("r+b") as file:  # the same inode, the same size
            file.write(b"B" * 64)
        assert path.stat().st_ino == inode
        await until(lambda: len(follower.contents) == 2, timeout=5)

    follower = follow(path, scenario)
    assert follower.contents == [b"A" * 64, b"B" * 64]


def test_a_rename_over_the_file_is_seen(workdir: Path) -> None:
    path = workdir / "root-cert.pem"
    path.write_bytes(b"old")

    async def scenario(_: PolledFile, follower: Follower) -> None:
        (workdir / "root-cert.pem.new").write_bytes(b"new")
        os.replace(workdir / "root-cert.pem.new", path)
        await until(lambda: len(follower.contents) == 2, timeout=5)

    follower = follow(path, scenario)
    assert follower.contents == [b"old", b"new"]


def test_a_touch_is_read_but_the_same_content_is_not_handed_over_again(workdir: Path) -> None:
    path = workdir / "root-cert.pem"
    path.write_bytes(b"same")

    async def scenario(polled: PolledFile, follower: Follower) -> None:
        os.utime(path, ns=(1, 1))
        await until(lambda: polled.reads == 2, timeout=5)
        await asyncio.sleep(0.1)

    follower = follow(path, scenario)
    assert follower.contents == [b"same"]


def test_a_missing_file_is_an_error_once_and_is_read_when_it_appears(workdir: Path) -> None:
    path = workdir / "root-cert.pem"

    async def scenario(_: PolledFile, follower: Follower) -> None:
        await asyncio.sleep(0.1)  # several polls of the missing file
        assert follower.errors == [f"{path} does not exist"]
        path.write_bytes(b"here now")
        await until(lambda: follower.contents == [b"here now"], timeout=5)
        path.unlink()
        await until(lambda: len(follower.errors) == 2, timeout=5)

    follower = follow(path, scenario)
    assert follower.errors == [f"{path} does not exist"] * 2


def test_a_fifo_is_refused_without_blocking(workdir: Path) -> None:
    path = workdir / "root-cert.pem"
    os.mkfifo(path)
    follower = follow(path, lambda *_: asyncio.sleep(0.05))
    assert follower.contents == []
    assert len(follower.errors) == 1 and "not a regular file (a FIFO)" in follower.errors[0]


def test_the_signature_follows_symlinks_and_names_the_target(workdir: Path) -> None:
    (workdir / "a").write_bytes(b"x")
    (workdir / "b").write_bytes(b"x")
    os.symlink("a", workdir / "link")
    first = FileSignature.of(workdir / "link")
    os.symlink("b", workdir / "link.tmp")
    os.replace(workdir / "link.tmp", workdir / "link")
    second = FileSignature.of(workdir / "link")
    assert first is not None and second is not None
    assert (first.target, second.target) == (str(workdir / "a"), str(workdir / "b"))
    assert first != second
    assert FileSignature.of(workdir / "missing") is None


def test_intervals_must_be_positive(workdir: Path) -> None:
    async def noop(_: bytes) -> None: ...

    with pytest.raises(ValueError, match="must be positive"):
        PolledFile(workdir / "x", SystemClock(), on_change=noop, on_error=print, interval=0)


def test_a_stuck_read_holds_one_thread_and_never_the_loop(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that hangs (a stuck NFS or FUSE mount, simulated by a read that waits for an
    event) is given up after `read_timeout`; the loop keeps turning, later polls fail at once
    (said once) instead of starting more threads, and the file is followed again once the
    mount comes back."""
    path = workdir / "root-cert.pem"
    path.write_bytes(b"first")
    mount_back = threading.Event()
    reads: list[Path] = []

    def hanging_read(file: Path, max_bytes: int) -> bytes:
        reads.append(file)
        mount_back.wait(10)
        return read_regular_file(file, max_bytes)

    monkeypatch.setattr(polled_file, "read_regular_file", hanging_read)
    follower = Follower()

    async def main() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        polled = PolledFile(
            path,
            SystemClock(),
            on_change=follower.changed,
            on_error=follower.failed,
            interval=0.02,
            settle=0.01,
            read_timeout=0.2,
        )
        await polled.start()
        try:
            assert follower.errors == [f"a stat or read of {path} did not return within 0.2s"]
            assert ticks >= 5  # the loop turned while the read hung
            path.write_bytes(b"second")
            await asyncio.sleep(0.3)
            assert len(reads) == 1  # no second thread on the stuck mount
            assert len(follower.errors) == 2 and "has not returned" in follower.errors[1]
            mount_back.set()
            await until(lambda: follower.contents == [b"second"], timeout=5)
        finally:
            mount_back.set()
            await polled.stop()
            ticker.cancel()

    asyncio.run(main())


class BrokenFollower(Follower):
    """A follower whose callbacks raise for some content: a caller's bug, or a content it did
    not foresee (an overflowing taint notice, before it was refused as such)."""

    async def changed(self, data: bytes) -> None:
        await super().changed(data)
        if data.startswith(b"bad"):
            raise OverflowError("date value out of range")

    def failed(self, reason: str) -> None:
        super().failed(reason)
        raise RuntimeError("the error handler broke too")


def test_a_callback_that_raises_is_said_once_and_the_file_is_still_followed(
    workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At start (where it would have stopped the agent) and later (where the poll task would
    have died without a word), whatever a callback raises is one ERROR for that content, and
    the next version is handed over as usual."""
    path = workdir / "root-cert.pem"
    path.write_bytes(b"bad at start")
    follower = BrokenFollower()

    async def scenario(_: PolledFile, __: Follower) -> None:
        path.write_bytes(b"good")
        await until(lambda: follower.contents[-1:] == [b"good"], timeout=5)
        path.write_bytes(b"bad later")
        await until(lambda: follower.contents[-1:] == [b"bad later"], timeout=5)
        await asyncio.sleep(0.3)  # polls and resyncs of the same bad content
        path.unlink()
        await until(lambda: len(follower.errors) == 1, timeout=5)
        path.write_bytes(b"good again")
        await until(lambda: follower.contents[-1:] == [b"good again"], timeout=5)

    with caplog.at_level(logging.ERROR, logger="agent.polled_file"):
        # the same bad content re-read often (resync): still said once
        follow(path, scenario, follower, resync_interval=0.05)
    assert follower.contents == [b"bad at start", b"good", b"bad later", b"good again"]
    said = [r.getMessage() for r in caplog.records if r.name == "agent.polled_file"]
    assert said == [
        f"unexpected error taking in the new content of {path}; still following the file",
        f"unexpected error taking in the new content of {path}; still following the file",
        f"unexpected error handling a failed read of {path} ({path} does not exist); "
        "still following the file",
    ]
    assert all(r.exc_info for r in caplog.records if r.name == "agent.polled_file")
