"""The data directory's lock, and the trust bundle the CA publishes there.

`data_dir_lock` is the exclusive `flock` every meshca process using `--data-dir` takes before
changing what is shared there (the self-signed slots, `state_store`; the dev issuer), so
several CA processes on one host share them. `publish_root_bundle` writes `root-cert.pem` and
the taint notice beside it, for both drivers.

Files are written atomically; a SIGKILL at any point leaves either the old or the new state.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path

from ca_server.errors import CaSetupError
from certs import SigningAuthority
from meshca.files import atomic_write, ensure_dir
from meshca.taint_notice import TAINT_NOTICE_NAME, encode_taint_notice

log = logging.getLogger(__name__)

ROOT_CERT_FILE = "root-cert.pem"


@contextlib.contextmanager
def writing_to_data_dir(what: str, path: Path) -> Iterator[None]:
    """Turns a refused write (read-only or full disk, permissions) into `CaSetupError` naming
    the file and what to fix, so start-up stops with a message instead of a traceback. Writes
    go through `atomic_write`, so a refused one leaves the previous file intact."""
    try:
        yield
    except OSError as exc:
        raise CaSetupError(
            f"cannot write {what} {path}: {exc.strerror or exc}; the data directory must be "
            "writable and have free space"
        ) from exc


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Exclusive lock shared by every meshca process using `data_dir`."""
    with writing_to_data_dir("the lock file", data_dir / ".lock"):
        ensure_dir(data_dir)
        handle = open(data_dir / ".lock", "a+")  # noqa: SIM115 - closed below
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def publish_root_bundle(
    data_dir: Path, authority: SigningAuthority, tainted_since: Mapping[str, datetime]
) -> Path:
    """Writes the trust bundle workloads verify with (the local `istio-ca-root-cert`) and,
    first, beside it the taint notice (`meshca.taint_notice`: `tainted_since`, which
    authorities are tainted and since when; `{}` for a plugged-in CA, which has no taints),
    each file atomically. Agents watch both, so a taint reaches them as fast as a new root
    does. The notice goes first: a reader never sees a bundle newer than the taints that came
    with it. `tainted_since` is required so that no caller writing the bundle of self-signed
    slots can forget their taints (it would publish an empty notice)."""
    notice = data_dir / TAINT_NOTICE_NAME
    with writing_to_data_dir("the taint notice", notice):
        atomic_write(notice, encode_taint_notice(tainted_since) + "\n")
    path = data_dir / ROOT_CERT_FILE
    with writing_to_data_dir("the root bundle", path):
        atomic_write(path, authority.root_bundle_pem)
    return path
