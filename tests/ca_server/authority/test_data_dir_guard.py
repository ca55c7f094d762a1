"""`ca_server.authority.data_dir_guard` on its own: the file names it checks are the ones the CA
writes, a symlink is judged by what it points at, and the sweep spares a write that may be in
progress. (The refusals as an operator meets them: tests/hostile/test_operator_surface.py.)"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from ca_server import dev_issuer
from ca_server.authority.data_dir_guard import (
    LOCKED_FILES,
    TRUSTED_FILES,
    DataDirPermissionError,
    check_data_dir,
    check_state_files,
    sweep_stale_temporaries,
)
from ca_server.authority.root_bundle import ROOT_CERT_FILE
from ca_server.authority.state_store import LEGACY_CERT, LEGACY_KEY, STATE_FILE


def test_the_checked_names_are_the_files_the_ca_writes() -> None:
    issuer = f"{dev_issuer._DIR}/{dev_issuer._KEY}"
    jwks = f"{dev_issuer._DIR}/{dev_issuer._JWKS}"
    assert set(LOCKED_FILES) == {STATE_FILE, LEGACY_KEY, LEGACY_CERT, issuer, jwks}
    assert {ROOT_CERT_FILE, ".lock"} <= set(TRUSTED_FILES)


def test_a_private_directory_passes_and_a_missing_one_is_left_to_be_created(tmp_path: Path):
    data_dir = tmp_path / "data"
    check_data_dir(data_dir)  # not there yet: `meshca ca` creates it, mode 0700
    data_dir.mkdir(mode=0o700)
    (data_dir / STATE_FILE).write_text("{}")
    os.chmod(data_dir / STATE_FILE, 0o600)
    check_data_dir(data_dir)
    check_state_files(data_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another uid")
def test_a_symlink_is_judged_by_the_file_it_points_at(tmp_path: Path):
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    theirs = tmp_path / "theirs.json"
    theirs.write_text("{}")
    os.chown(theirs, 65534, 65534)
    (data_dir / STATE_FILE).symlink_to(theirs)
    with pytest.raises(DataDirPermissionError, match="is owned by uid 65534"):
        check_state_files(data_dir)


def test_the_sweep_takes_every_abandoned_temporary_and_spares_a_write_in_progress(
    tmp_path: Path,
):
    """A leftover goes at once, however young (a `root-cert.pem` one used to be spared for a
    minute, then never looked at again); one whose writer still holds it stays, in any file;
    nothing but `atomic_write`'s names is touched."""
    (tmp_path / "dev-issuer").mkdir()
    state_tmp = tmp_path / ".authorities.json.abc12345.tmp"
    issuer_tmp = tmp_path / "dev-issuer" / ".signing-key.pem.def45678.tmp"
    root_tmp = tmp_path / ".root-cert.pem.young123.tmp"
    notice_tmp = tmp_path / ".meshca-taints.json.x1y2z3w4.tmp"
    in_progress = tmp_path / ".root-cert.pem.writing1.tmp"
    others = [tmp_path / name for name in ("notes.tmp", ".root-cert.pem.tmp", "root-cert.pem")]
    for path in (state_tmp, issuer_tmp, root_tmp, notice_tmp, in_progress, *others):
        path.write_text("x")
    with open(in_progress, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)  # as atomic_write holds its own
        removed = sweep_stale_temporaries(tmp_path)
    assert set(removed) == {state_tmp, issuer_tmp, root_tmp, notice_tmp}
    assert in_progress.exists() and all(path.exists() for path in others)
    assert sweep_stale_temporaries(tmp_path) == [in_progress]
