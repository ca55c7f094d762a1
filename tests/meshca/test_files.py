from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshca.files import atomic_write, ensure_dir, fsync_dir, remove_abandoned_temporaries


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """Umask 0: any restriction seen must come from atomic_write itself."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_writes_bytes_and_text(tmp_path: Path) -> None:
    atomic_write(tmp_path / "a.pem", b"bytes\n")
    atomic_write(tmp_path / "b.pem", "text\n")
    assert (tmp_path / "a.pem").read_bytes() == b"bytes\n"
    assert (tmp_path / "b.pem").read_text() == "text\n"
    assert _mode(tmp_path / "a.pem") == 0o644


def test_replaces_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "cert-chain.pem"
    atomic_write(target, "old")
    atomic_write(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cert-chain.pem"]


def test_private_mode_is_set_before_the_file_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, permissive_umask: None
) -> None:
    """The key is 0600 from its first byte: checked on the temp file at rename time."""
    seen: list[tuple[str, int, bytes]] = []
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        src_path = Path(src)
        seen.append((src_path.name, _mode(src_path), src_path.read_bytes()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    target = tmp_path / "key.pem"
    atomic_write(target, b"secret", mode=0o600)
    assert len(seen) == 1
    temp_name, temp_mode, temp_content = seen[0]
    assert temp_name != "key.pem" and temp_name.startswith(".key.pem.")
    assert temp_mode == 0o600
    assert temp_content == b"secret"
    assert _mode(target) == 0o600


def test_mode_replaces_mode_of_previous_file(tmp_path: Path, permissive_umask: None) -> None:
    target = tmp_path / "key.pem"
    atomic_write(target, "v1", mode=0o644)
    atomic_write(target, "v2", mode=0o600)
    assert _mode(target) == 0o600


def test_mode_is_not_narrowed_by_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "root-cert.pem", "root", mode=0o644)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "root-cert.pem") == 0o644


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failure_leaves_no_temp_file_and_keeps_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    target = tmp_path / "key.pem"
    atomic_write(target, "old", mode=0o600)

    def boom(*args: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write(target, "new", mode=0o600)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.pem"]
    assert target.read_text() == "old"


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "x.pem", "x")
    assert list(tmp_path.iterdir()) == []


def test_ensure_dir_creates_with_mode(tmp_path: Path, permissive_umask: None) -> None:
    path = tmp_path / "a" / "b"
    assert ensure_dir(path) == path
    assert path.is_dir()
    assert _mode(path) == 0o700
    assert ensure_dir(path, mode=0o755) == path  # existing directory accepted as is
    assert _mode(path) == 0o700


def test_fsync_dir(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")


def test_the_temporary_file_is_locked_until_it_is_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What lets a sweep tell a write in progress from a leftover: at rename time another
    open file cannot lock the temporary file."""
    held: list[bool] = []
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        with open(src, "rb") as other:
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        assert remove_abandoned_temporaries(tmp_path) == []
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    atomic_write(tmp_path / "root-cert.pem", "root")
    assert held == [True]
    assert (tmp_path / "root-cert.pem").read_text() == "root"


def test_abandoned_temporaries_go_and_nothing_else(tmp_path: Path) -> None:
    leftovers = [tmp_path / ".root-cert.pem.k1ll3d_x.tmp", tmp_path / ".key.pem.abcdefgh.tmp"]
    kept = [
        tmp_path / name
        for name in ("root-cert.pem", ".root-cert.pem.tmp", ".key.pem.short.tmp", "x.tmp")
    ]
    for path in (*leftovers, *kept):
        path.write_text("x")
    (tmp_path / "sub").mkdir()
    below = tmp_path / "sub" / ".a.pem.abcdefgh.tmp"
    below.write_text("x")
    (tmp_path / ".b.pem.abcdefgh.tmp").symlink_to(below)
    assert sorted(remove_abandoned_temporaries(tmp_path)) == sorted(leftovers)
    assert all(path.exists() for path in (*kept, below))
    assert remove_abandoned_temporaries(tmp_path / "missing") == []


def test_a_sweep_between_creating_and_locking_makes_the_writer_start_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary file exists, unlocked, for an instant before its writer locks it; a sweep
    in that instant removes it, and the writer must notice and write under a new name rather
    than fail at its rename (or write a file nobody will ever rename)."""
    real_mkstemp = tempfile.mkstemp
    names: list[str] = []

    def mkstemp_then_sweep(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(*args, **kwargs)
        names.append(name)
        if len(names) == 1:
            assert remove_abandoned_temporaries(tmp_path) == [Path(name)]
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_sweep)
    atomic_write(tmp_path / "root-cert.pem", "root")
    assert len(names) == 2
    assert (tmp_path / "root-cert.pem").read_text() == "root"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root-cert.pem"]
