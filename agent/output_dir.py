"""The output directory's layout, both directions: write a generation, read the current one.

Applications reading `cert-chain.pem` and `key.pem` must never see the new certificate with the
old key. Writing each file atomically is not enough for that, so this uses the kubelet's
projected-volume layout:

    DIR/..2030_01_01_00_00_00.abc123/{cert-chain.pem,key.pem,root-cert.pem}   one generation
    DIR/..data -> ..2030_01_01_00_00_00.abc123                                 swapped atomically
    DIR/cert-chain.pem -> ..data/cert-chain.pem   (and key.pem, root-cert.pem)

`write_generation()` writes a complete new generation directory, then replaces the `..data`
symlink with one `rename(2)` (temp symlink + `os.replace`). A reader that resolves `..data` once
and reads from that directory sees one consistent set; `read_current()` does exactly that. The
previous generation is kept (a reader that resolved `..data` just before a swap can finish) and
older ones are removed.

This is the only module that knows the layout: `agent.file_output` writes through it and
`agent.cert_state` reads through it. Blocking file I/O; only one writer per directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from agent.errors import CertificateNotRestored, NoPreviousCertificate
from meshca.files import ensure_dir, fsync_dir

CERT_CHAIN_FILE = "cert-chain.pem"
KEY_FILE = "key.pem"
ROOT_CERT_FILE = "root-cert.pem"
DATA_LINK = "..data"
FILE_MODES = {CERT_CHAIN_FILE: 0o644, KEY_FILE: 0o600, ROOT_CERT_FILE: 0o644}


@dataclass(frozen=True)
class CertificateFiles:
    """The text of one generation's three files."""

    chain_pem: str
    key_pem: str = field(repr=False)
    root_pem: str


def write_generation(directory: Path, files: CertificateFiles, now: datetime) -> Path:
    """Publishes one complete generation in `directory`; returns the generation's directory.
    Raises `OSError` with nothing half-written left behind."""
    ensure_dir(directory, 0o700)
    stamp = now.strftime("%Y_%m_%d_%H_%M_%S.%f")
    generation = Path(tempfile.mkdtemp(prefix=f"..{stamp}.", dir=directory))
    contents = {
        CERT_CHAIN_FILE: files.chain_pem,
        KEY_FILE: files.key_pem,
        ROOT_CERT_FILE: files.root_pem,
    }
    try:
        os.chmod(generation, 0o755)
        for name, text in contents.items():
            _write_file(generation / name, text.encode("ascii"), FILE_MODES[name])
        fsync_dir(generation)
    except BaseException:
        shutil.rmtree(generation, ignore_errors=True)  # never leave half a generation
        raise
    previous = _link_target(directory / DATA_LINK)
    _replace_symlink(directory / DATA_LINK, generation.name)
    for name in contents:
        link = directory / name
        target = f"{DATA_LINK}/{name}"
        if not (link.is_symlink() and os.readlink(link) == target):
            _replace_symlink(link, target)
    fsync_dir(directory)
    _remove_old_generations(directory, keep={generation.name, previous})
    return generation


def read_current(directory: Path) -> tuple[CertificateFiles, Path]:
    """The current generation's files and the directory they were read from (`..data`
    resolved once, so the three come from one generation; a plain directory of three files is
    read as is). Raises `NoPreviousCertificate` when none of the files exists and
    `CertificateNotRestored` when they cannot be read as PEM text."""
    source = _current_generation(directory)
    paths = [source / name for name in (CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE)]
    if not any(path.exists() for path in paths):
        raise NoPreviousCertificate(f"no {CERT_CHAIN_FILE}, {KEY_FILE} or {ROOT_CERT_FILE}")
    chain, key, root = (_read_pem(path) for path in paths)
    return CertificateFiles(chain, key, root), source


def remove_directory(directory: Path) -> None:
    """Removes an identity's directory and, once empty, its parent (node mode's namespace)."""
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.parent.rmdir()


def _current_generation(directory: Path) -> Path:
    data = directory / DATA_LINK
    if data.is_symlink():
        return Path(os.path.realpath(data))
    return directory


def _read_pem(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CertificateNotRestored(
            f"cannot read {path.name}: {exc.strerror or type(exc).__name__}"
        ) from None
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise CertificateNotRestored(f"{path.name} is not a PEM text file") from None


def _remove_old_generations(directory: Path, keep: set[str | None]) -> None:
    """Removes every generation but the current one and the one it replaced."""
    for old in directory.iterdir():
        if _is_generation(old) and old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def _is_generation(path: Path) -> bool:
    return (
        path.name.startswith("..")
        and path.name != DATA_LINK
        and not path.name.endswith(".tmp")
        and path.is_dir()
        and not path.is_symlink()
    )


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Creates `path` with `mode` from the start (a key is never briefly world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # umask may have narrowed the mode given to open()
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_symlink(link: Path, target: str) -> None:
    """Points `link` at `target` atomically: new symlink beside it, then rename over it."""
    tmp = link.with_name(f"{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _link_target(link: Path) -> str | None:
    """Where a symlink points, or None when there is none yet."""
    try:
        return os.readlink(link)
    except OSError:
        return None
