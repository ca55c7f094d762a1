"""Where the CA's signing material comes from, and where its trust bundle is published.

Sources, chosen once at start-up (`ca_server.server.authority_source_for`):
- self-signed authorities are slots in `--data-dir` (`ca_server.authority.state_store`), changed
  only under the directory's exclusive `flock` (`data_dir_lock`), so several CA processes on
  one host share them;
- `PluggedCaDirectory`: an operator-provided CA (Istio's `cacerts` layout), validated on load and
  re-read when its files change.

Both write files atomically; a SIGKILL at any point leaves either the old or the new state.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from ca_server.errors import CaSetupError
from certs import (
    CertsError,
    SigningAuthority,
    load_cert,
    load_certs,
    load_private_key,
    make_authority,
)
from meshca.files import atomic_write, ensure_dir
from meshca.taint_notice import TAINT_NOTICE_NAME, encode_taint_notice

log = logging.getLogger(__name__)

ROOT_CERT_FILE = "root-cert.pem"

# Istio's plugged-in CA layouts: (cert, key, root, chain) file names.
ISTIO_LAYOUT = ("ca-cert.pem", "ca-key.pem", "root-cert.pem", "cert-chain.pem")
TLS_LAYOUT = ("tls.crt", "tls.key", "ca.crt")


class AuthoritySource(Protocol):
    def load(self, now: datetime) -> SigningAuthority:
        """The current signing material, validated at `now`."""
        ...

    def fingerprint(self) -> str:
        """Changes whenever the underlying files change (cheap: compared on every poll)."""
        ...

    @property
    def description(self) -> str: ...


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


def _files_fingerprint(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        try:
            digest.update(path.read_bytes())
        except FileNotFoundError:
            digest.update(b"<missing>")
    return digest.hexdigest()


@dataclass
class PluggedCaDirectory:
    """Istio's `cacerts`: `ca-cert.pem ca-key.pem root-cert.pem cert-chain.pem`, or the
    cert-manager style `tls.crt tls.key ca.crt`."""

    directory: Path
    layout: tuple[str, ...]

    @property
    def description(self) -> str:
        return f"plugged-in CA from {self.directory}"

    def fingerprint(self) -> str:
        return _files_fingerprint([self.directory / name for name in self.layout])

    def load(self, now: datetime) -> SigningAuthority:
        files = {name: self.directory / name for name in self.layout}
        try:
            if self.layout == ISTIO_LAYOUT:
                cert_name, key_name, root_name, chain_name = ISTIO_LAYOUT
                cert = load_cert(files[cert_name].read_bytes(), what=cert_name)
                chain = load_certs(files[chain_name].read_bytes(), what=chain_name)
            else:
                cert_name, key_name, root_name = TLS_LAYOUT
                chain = load_certs(files[cert_name].read_bytes(), what=cert_name)
                cert = chain[0]
            key = load_private_key(files[key_name].read_bytes())
            roots = load_certs(files[root_name].read_bytes(), what=root_name)
            authority = make_authority(cert, key, chain, roots)
            authority.validate(now=now)
        except FileNotFoundError as exc:
            raise CaSetupError(f"plugged-in CA file disappeared: {exc.filename}") from exc
        except CertsError as exc:
            raise CaSetupError(f"plugged-in CA in {self.directory} is unusable: {exc}") from exc
        return authority


def detect_plugged_ca(directory: Path) -> PluggedCaDirectory | None:
    """All files of one layout → that layout; some → `CaSetupError` naming what is missing;
    none → `None` (use a self-signed root)."""
    for layout in (ISTIO_LAYOUT, TLS_LAYOUT):
        present = [name for name in layout if (directory / name).exists()]
        if len(present) == len(layout):
            return PluggedCaDirectory(directory, layout)
        if present:
            missing = [name for name in layout if name not in present]
            raise CaSetupError(
                f"incomplete plugged-in CA in {directory}: found {present} but missing {missing}; "
                f"provide all of {list(layout)} (or none, for a self-signed root)"
            )
    return None


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
