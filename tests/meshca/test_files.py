from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshca.files import atomic_write, ensure_dir, fsync_dir


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
