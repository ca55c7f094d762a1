"""The CA's data directory, checked before it is trusted (the way `sshd`'s StrictModes checks a
user's keys), and swept of what a crash left behind.

Whoever can write `--data-dir` can rename a crafted `authorities.json` (their own key as the
active authority) into it, and the CA would sign with that key within one poll. So the CA refuses
to start on, or to load state from, a data directory or a file in it that

- is owned by a user other than the one the CA runs as (root is accepted as the owner too), or
- is writable by its group or by others (mode bits 0o022),

and names the path and the `chmod`/`chown` that fixes it. The directory itself, the directories
meshca keeps in it (`dev-issuer/`, `leaves/`, `agents/`) and the files the CA trusts
(`TRUSTED_FILES`) are checked at start (`check_data_dir`), and the state files again before
every reload (`check_state_files`), so a directory made writable while the CA runs stops the
reload, loudly, and the CA keeps the authority it has. The parents of `--data-dir` are not
walked (a volume's mount point may be shared); docs/security.md says to keep the path's parents
root-owned.

`sweep_stale_temporaries` removes the temporary files `meshca.files.atomic_write` leaves when a
process is killed between writing and renaming (`.authorities.json.*.tmp` holds every private
key), in the data directory and the directories meshca keeps in it. `root-cert.pem` and the taint
notice beside it are also published without the data directory's lock (by every CA process, and
in Kubernetes mode), so another process may be writing one right now: each writer holds a lock on
its own temporary file until the rename, and the sweep removes only the ones nobody holds, at
once. So a `meshca authority activate` killed just before its last rename leaves nothing behind
at the CA's next start (a leftover used to be spared by its age, then never looked at again).
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
from collections.abc import Iterable
from pathlib import Path

from ca_server.errors import CaSetupError
from meshca.files import remove_abandoned_temporaries

log = logging.getLogger(__name__)

# Written under the data directory's lock (`root_bundle.data_dir_lock`): the authority state and
# its derived Istio-layout pair, and the development issuer (`ca_server.dev_issuer`).
LOCKED_FILES = (
    "authorities.json",
    "ca-key.pem",
    "ca-cert.pem",
    "dev-issuer/signing-key.pem",
    "dev-issuer/jwks.json",
)
# Published without the lock too (`root_bundle.publish_root_bundle`, by every CA process).
UNLOCKED_FILES = ("root-cert.pem",)
TRUSTED_FILES = (*LOCKED_FILES, *UNLOCKED_FILES, ".lock")
STATE_FILES = LOCKED_FILES[:3]
KEPT_DIRS = ("dev-issuer", "leaves", "agents")
_GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


class DataDirPermissionError(CaSetupError):
    """The data directory (or a file in it) could be changed by someone other than the CA."""


def check_data_dir(data_dir: Path) -> None:
    """At start: `data_dir` (if it exists yet), the directories meshca keeps in it and every
    file the CA trusts. Raises `DataDirPermissionError` for the first that fails."""
    _check(data_dir, directory=True, flag="--data-dir ")
    for name in KEPT_DIRS:
        _check(data_dir / name, directory=True)
    _check_files(data_dir, TRUSTED_FILES)


def check_state_files(data_dir: Path) -> None:
    """Before each load of the authority state: the directory and the state files."""
    _check(data_dir, directory=True, flag="--data-dir ")
    _check_files(data_dir, STATE_FILES)


def _check_files(data_dir: Path, names: Iterable[str]) -> None:
    for name in names:
        _check(data_dir / name, directory=False)


def _check(path: Path, *, directory: bool, flag: str = "") -> None:
    try:
        info = os.stat(path)  # follows a symlink: what counts is what would be read
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DataDirPermissionError(f"cannot check {flag}{path}: {exc.strerror or exc}") from exc
    kind = "directory" if directory else "regular file"
    if stat.S_ISDIR(info.st_mode) != directory or not (directory or stat.S_ISREG(info.st_mode)):
        raise DataDirPermissionError(
            f"{flag}{path} is not a {kind}: give the CA its own directory (created if missing)"
            if directory
            else f"{path} is not a regular file: remove it or restore the CA's file"
        )
    uid = os.geteuid()
    quoted = shlex.quote(str(path))
    if info.st_uid not in (uid, 0):
        raise DataDirPermissionError(
            f"{flag}{path} is owned by uid {info.st_uid}, not by the user the CA runs as (uid "
            f"{uid}) or root: whoever owns it can replace the CA's keys; check its content, then "
            f"`chown {uid} {quoted}` (or run the CA as that user)"
        )
    if info.st_mode & _GROUP_OR_OTHER_WRITE:
        who = {stat.S_IWGRP: "its group", stat.S_IWOTH: "others"}.get(
            info.st_mode & _GROUP_OR_OTHER_WRITE, "its group and others"
        )
        raise DataDirPermissionError(
            f"{flag}{path} is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o}): they "
            f"could replace the CA's keys; check its content, then `chmod go-w {quoted}`"
        )


def sweep_stale_temporaries(data_dir: Path) -> list[Path]:
    """Removes `atomic_write`'s leftovers in `data_dir` and the directories meshca keeps in it
    (`meshca.files.remove_abandoned_temporaries`: only its temporary-file names, and only those
    no live writer holds); returns what it removed (logged: a leftover means a process died
    mid-write)."""
    removed = remove_abandoned_temporaries(data_dir)
    for name in KEPT_DIRS:
        removed.extend(remove_abandoned_temporaries(data_dir / name))
    if removed:
        log.warning(
            "removed %d temporary file(s) a killed meshca process left in %s: %s",
            len(removed),
            data_dir,
            ", ".join(str(p.relative_to(data_dir)) for p in removed),
        )
    return removed
