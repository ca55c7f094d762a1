"""Where the CA's signing material comes from, and where its trust bundle is published.

Two sources, chosen once at start-up (`authority_source_for`):
- `SelfSignedRootStore`: a root generated on first start under `--data-dir`, reused afterwards.
  Creation happens under an exclusive `flock` on the data directory, so several CA processes on
  one host (one per core, later) end up sharing one root.
- `PluggedCaDirectory`: an operator-provided CA (Istio's `cacerts` layout), validated on load and
  re-read when its files change.

Both write files atomically; a SIGKILL at any point leaves either the old or the new state.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

from certs import (
    CertsError,
    KeySpec,
    SigningAuthority,
    load_cert,
    load_certs,
    load_private_key,
    make_authority,
    new_self_signed_authority,
    private_key_to_pem,
    self_signed_authority,
)
from certs.pem import cert_to_pem
from meshca.files import atomic_write, ensure_dir

log = logging.getLogger(__name__)

ROOT_CERT_FILE = "root-cert.pem"
_SELF_SIGNED_KEY = "ca-key.pem"
_SELF_SIGNED_CERT = "ca-cert.pem"

# Istio's plugged-in CA layouts: (cert, key, root, chain) file names.
ISTIO_LAYOUT = ("ca-cert.pem", "ca-key.pem", "root-cert.pem", "cert-chain.pem")
TLS_LAYOUT = ("tls.crt", "tls.key", "ca.crt")


class CaSetupError(RuntimeError):
    """The CA's signing material is missing, incomplete or inconsistent; refuse to start."""


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
class SelfSignedRootStore:
    data_dir: Path
    trust_domain: str
    key_spec: KeySpec
    lifetime: timedelta

    @property
    def description(self) -> str:
        return f"self-signed root in {self.data_dir}"

    def _paths(self) -> tuple[Path, Path]:
        return self.data_dir / _SELF_SIGNED_KEY, self.data_dir / _SELF_SIGNED_CERT

    def fingerprint(self) -> str:
        return _files_fingerprint(list(self._paths()))

    def load(self, now: datetime) -> SigningAuthority:
        key_path, cert_path = self._paths()
        with data_dir_lock(self.data_dir):
            if cert_path.exists() and not key_path.exists():
                raise CaSetupError(
                    f"{cert_path} exists without {key_path}: restore the key or remove both to "
                    "generate a new root (workloads will then need the new root-cert.pem)"
                )
            if not cert_path.exists():
                self._create(now)
            try:
                key = load_private_key(key_path.read_bytes())
                cert = load_cert(cert_path.read_bytes(), what=str(cert_path))
            except CertsError as exc:
                raise CaSetupError(f"cannot load the self-signed root: {exc}") from exc
        authority = self_signed_authority(cert, key)
        try:
            authority.validate(now=now)
        except CertsError as exc:
            raise CaSetupError(f"self-signed root in {self.data_dir} is unusable: {exc}") from exc
        return authority

    def _create(self, now: datetime) -> None:
        """Key first, certificate second: a crash in between leaves no certificate, so the next
        start simply generates both again (nothing can have been issued from it)."""
        key_path, cert_path = self._paths()
        root = new_self_signed_authority(
            self.key_spec, self.trust_domain, now=now, lifetime=self.lifetime
        )
        with writing_to_data_dir("the new root key", key_path):
            atomic_write(key_path, private_key_to_pem(root.key), mode=0o600)
        with writing_to_data_dir("the new root certificate", cert_path):
            atomic_write(cert_path, cert_to_pem(root.cert))
        log.info("generated a new %s self-signed root for %s", self.key_spec, self.trust_domain)


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


def publish_root_bundle(data_dir: Path, authority: SigningAuthority) -> Path:
    """Writes the trust bundle workloads verify with (the local `istio-ca-root-cert`)."""
    path = data_dir / ROOT_CERT_FILE
    with writing_to_data_dir("the root bundle", path):
        atomic_write(path, authority.root_bundle_pem)
    return path
