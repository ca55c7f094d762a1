"""Writes the workload's certificate, key and root to a directory, atomically as a set.

Applications reading `cert-chain.pem` and `key.pem` must never see the new certificate with the
old key. Writing each file atomically is not enough for that, so this uses the kubelet's
projected-volume layout:

    OUTPUT/..2030_01_01_00_00_00.abc123/{cert-chain.pem,key.pem,root-cert.pem}   one generation
    OUTPUT/..data -> ..2030_01_01_00_00_00.abc123                                 swapped atomically
    OUTPUT/cert-chain.pem -> ..data/cert-chain.pem   (and key.pem, root-cert.pem)

Each change writes a complete new generation directory, then replaces the `..data` symlink with
one `rename(2)` (temp symlink + `os.replace`). A reader that resolves `..data` once and reads
from that directory sees one consistent set. The previous generation is kept (so a reader that
resolved `..data` just before a swap can finish) and older ones are removed.

The first set a `FileOutput` is given is not written if the current generation already holds
exactly that text: the certificate a restarted agent restored from these files
(`agent.cert_state`) stays where it is instead of being copied into a new generation.

Node mode: `NodeFileOutput` keeps one `FileOutput` per identity under `OUTPUT/<ns>/<sa>/`,
created when the identity's first certificate is published (its SDS name is its SPIFFE ID) and
removed, directory and all, when the identity's secret is removed from the cache.

Concurrency: `write()` is synchronous and is called from the event loop (a cache listener);
it writes three small files and fsyncs them, well under a millisecond to a few milliseconds.
Only one writer may use a directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from agent.secrets import DEFAULT_RESOURCE, ROOT_RESOURCE, RootSecret, Secret, TlsSecret
from certs import SpiffeId, SpiffeIdError
from meshca.clock import Clock, SystemClock
from meshca.files import ensure_dir, fsync_dir

log = logging.getLogger(__name__)

CERT_CHAIN_FILE = "cert-chain.pem"
KEY_FILE = "key.pem"
ROOT_CERT_FILE = "root-cert.pem"
DATA_LINK = "..data"
_FILE_MODES = {CERT_CHAIN_FILE: 0o644, KEY_FILE: 0o600, ROOT_CERT_FILE: 0o644}


class FileOutput:
    """Mirrors the cache's `default` (or `tls_resource`) and `ROOTCA` secrets into `directory`
    (OUTPUT_CERTS)."""

    def __init__(
        self, directory: Path, clock: Clock | None = None, *, tls_resource: str = DEFAULT_RESOURCE
    ) -> None:
        self.directory = directory
        self.tls_resource = tls_resource
        self._clock = clock or SystemClock()
        self._tls: TlsSecret | None = None
        self._root: RootSecret | None = None
        self._written: tuple[str, str] | None = None
        self.writes = 0

    def on_secret(self, secret: Secret) -> None:
        """`SecretCache` listener: writes a new generation once both halves are known."""
        if isinstance(secret, TlsSecret) and secret.name == self.tls_resource:
            self._tls = secret
        elif isinstance(secret, RootSecret) and secret.name == ROOT_RESOURCE:
            self._root = secret
        else:
            return
        if self._tls is None or self._root is None:
            return
        versions = (self._tls.version, self._root.version)
        if versions == self._written:
            return
        tls, root = self._tls, self._root
        if self._written is None and self._on_disk() == (
            tls.cert_chain_pem,
            tls.private_key_pem,
            root.trusted_ca_pem,
        ):
            # A previous run's set, restored by the SecretManager: already there, keep it.
            log.info("certificate files in %s are already current; not rewritten", self.directory)
            self._written = versions
            return
        try:
            self.write(tls.cert_chain_pem, tls.private_key_pem, root.trusted_ca_pem)
        except OSError as exc:
            # The in-memory secret (SDS) stays correct; the files catch up on the next change.
            log.error("could not write certificates to %s: %s", self.directory, exc)
            return
        self._written = versions

    def _on_disk(self) -> tuple[str, str, str] | None:
        """The current generation's (chain, key, root) text, or None if it cannot be read."""
        data = self.directory / DATA_LINK
        if not data.is_symlink():
            return None
        generation = Path(os.path.realpath(data))
        try:
            chain, key, root = (
                (generation / name).read_text(encoding="ascii")
                for name in (CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE)
            )
        except (OSError, UnicodeDecodeError):
            return None
        return chain, key, root

    def write(self, cert_chain_pem: str, key_pem: str, root_pem: str) -> Path:
        """Publishes one complete generation; returns its directory."""
        ensure_dir(self.directory, 0o700)
        stamp = self._clock.now().strftime("%Y_%m_%d_%H_%M_%S.%f")
        generation = Path(tempfile.mkdtemp(prefix=f"..{stamp}.", dir=self.directory))
        contents = {CERT_CHAIN_FILE: cert_chain_pem, KEY_FILE: key_pem, ROOT_CERT_FILE: root_pem}
        try:
            os.chmod(generation, 0o755)
            for name, text in contents.items():
                _write_file(generation / name, text.encode("ascii"), _FILE_MODES[name])
            fsync_dir(generation)
        except BaseException:
            shutil.rmtree(generation, ignore_errors=True)  # never leave half a generation
            raise
        previous = _link_target(self.directory / DATA_LINK)
        _replace_symlink(self.directory / DATA_LINK, generation.name)
        for name in contents:
            link = self.directory / name
            target = f"{DATA_LINK}/{name}"
            if not (link.is_symlink() and os.readlink(link) == target):
                _replace_symlink(link, target)
        fsync_dir(self.directory)
        self._remove_old_generations(keep={generation.name, previous})
        self.writes += 1
        log.info("wrote certificate files to %s", self.directory)
        return generation

    def _remove_old_generations(self, keep: set[str | None]) -> None:
        """Removes every generation but the current one and the one it replaced."""
        for old in self.directory.iterdir():
            if _is_generation(old) and old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)


class NodeFileOutput:
    """Node mode: `OUTPUT/<ns>/<sa>/{cert-chain,key,root-cert}.pem` for every identity whose
    certificate is in the cache (SDS name = SPIFFE ID); a `SecretCache` listener and removal
    listener."""

    def __init__(self, directory: Path, clock: Clock | None = None) -> None:
        self.directory = directory
        self._clock = clock or SystemClock()
        self._root: RootSecret | None = None
        self.outputs: dict[str, FileOutput] = {}

    def on_secret(self, secret: Secret) -> None:
        if isinstance(secret, RootSecret) and secret.name == ROOT_RESOURCE:
            self._root = secret
            for existing in self.outputs.values():
                existing.on_secret(secret)
            return
        if not isinstance(secret, TlsSecret):
            return
        output = self.outputs.get(secret.name) or self._add(secret.name)
        if output is not None:
            output.on_secret(secret)

    def _add(self, name: str) -> FileOutput | None:
        identity = _identity_of(name)
        if identity is None:
            return None
        output = FileOutput(
            self.directory / identity.namespace / identity.service_account,
            self._clock,
            tls_resource=name,
        )
        self.outputs[name] = output
        if self._root is not None:
            output.on_secret(self._root)
        return output

    def on_secret_removed(self, name: str) -> None:
        output = self.outputs.pop(name, None)
        if output is None:
            return
        shutil.rmtree(output.directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # the namespace directory, once empty
            output.directory.parent.rmdir()
        log.info("removed certificate files in %s", output.directory)


def _identity_of(name: str) -> SpiffeId | None:
    if not name.startswith("spiffe://"):
        return None
    try:
        return SpiffeId.parse(name)
    except SpiffeIdError:
        return None


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
