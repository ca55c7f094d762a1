"""Mirrors the served certificates into files (OUTPUT_CERTS / `--output-dir`), and restores them.

One `FileOutput` per agent, a `SecretCache` listener, with a layout per mode that says which
directory a secret's files go to:

- `FileOutput.single(OUTPUT)`: the `default` certificate in `OUTPUT/`;
- `FileOutput.node(OUTPUT)`: every identity's certificate (SDS name = its SPIFFE ID) in
  `OUTPUT/<ns>/<sa>/`, created with its first certificate and removed, directory and all, when
  the identity's secret leaves the cache.

Each directory gets `cert-chain.pem`, `key.pem` and the `ROOTCA` bundle as `root-cert.pem`,
written as one generation once both halves are known (`agent.output_dir` owns the layout).

Both directions live here: `restore()` is the scheduler's per-identity start hook. It reads the
identity's directory (`agent.cert_state`) and remembers what it found, so the first publish of
that same set is not copied into a new generation: the restored files stay where they are.

Concurrency: `on_secret`/`on_secret_removed` run on the event loop and write synchronously
(three small fsynced files, a few milliseconds); `restore` runs in a worker thread before the
identity's first publish, and only records what it read. Only one writer may use a directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from agent.cert_state import RestoredCertificate, load_previous_certificate
from agent.output_dir import CertificateFiles, remove_directory, write_generation
from agent.secrets import DEFAULT_RESOURCE, ROOT_RESOURCE, RootSecret, Secret, TlsSecret
from certs import SpiffeId, SpiffeIdError
from meshca.clock import Clock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputLayout:
    """Where a TLS secret's files go under `root`: `default` in `root` itself (pod agent), or
    each SPIFFE ID in `root/<ns>/<sa>` (node agent, `per_identity`)."""

    root: Path
    per_identity: bool = False

    def directory_for(self, name: str) -> Path | None:
        """The directory for secret `name`, or None if this layout does not write it."""
        if not self.per_identity:
            return self.root if name == DEFAULT_RESOURCE else None
        if not name.startswith("spiffe://"):
            return None
        try:
            identity = SpiffeId.parse(name)
        except SpiffeIdError:
            return None
        return self.root / identity.namespace / identity.service_account


class FileOutput:
    """Writes each TLS secret the layout places, with the current root bundle, as a set."""

    def __init__(self, layout: OutputLayout, clock: Clock) -> None:
        self.layout = layout
        self._clock = clock
        self._tls: dict[str, TlsSecret] = {}
        self._root: RootSecret | None = None
        self._written: dict[str, tuple[str, str]] = {}  # name -> (tls, root) versions on disk
        self._restored: dict[str, CertificateFiles] = {}  # name -> text found by restore()
        self.writes = 0

    @classmethod
    def single(cls, directory: Path, clock: Clock) -> FileOutput:
        return cls(OutputLayout(directory), clock)

    @classmethod
    def node(cls, directory: Path, clock: Clock) -> FileOutput:
        return cls(OutputLayout(directory, per_identity=True), clock)

    @property
    def directories(self) -> dict[str, Path]:
        """Secret name -> the directory holding its files, for every name written so far."""
        return {
            name: path
            for name in self._tls
            if (path := self.layout.directory_for(name)) is not None
        }

    # -- the scheduler's start hook -------------------------------------------------------

    def restore(self, identity: SpiffeId, name: str, now: datetime) -> RestoredCertificate:
        """The certificate a previous run left for secret `name`, if `agent.cert_state` lets
        `identity` serve it at `now` (raises `CertificateNotRestored` otherwise). Blocking."""
        directory = self.layout.directory_for(name)
        if directory is None:
            raise ValueError(f"the output layout has no directory for {name!r}")
        restored = load_previous_certificate(directory, identity, now)
        self._restored[name] = CertificateFiles(
            restored.signed.chain_pem, restored.key_pem, restored.signed.root_bundle_pem
        )
        return restored

    # -- SecretCache listeners ------------------------------------------------------------

    def on_secret(self, secret: Secret) -> None:
        """Writes a new generation for every directory whose set changed."""
        if isinstance(secret, RootSecret) and secret.name == ROOT_RESOURCE:
            self._root = secret
            names = list(self._tls)
        elif isinstance(secret, TlsSecret) and self.layout.directory_for(secret.name):
            self._tls[secret.name] = secret
            names = [secret.name]
        else:
            return
        for name in names:
            self._sync(name)

    def on_secret_removed(self, name: str) -> None:
        """Node layout: an identity left the node, so its directory goes too."""
        if self._tls.pop(name, None) is None:
            return
        self._written.pop(name, None)
        self._restored.pop(name, None)
        directory = self.layout.directory_for(name)
        if self.layout.per_identity and directory is not None:
            remove_directory(directory)
            log.info("removed certificate files in %s", directory)

    def _sync(self, name: str) -> None:
        tls, root, directory = self._tls[name], self._root, self.layout.directory_for(name)
        if root is None or directory is None:
            return
        versions = (tls.version, root.version)
        if versions == self._written.get(name):
            return
        files = CertificateFiles(tls.cert_chain_pem, tls.private_key_pem, root.trusted_ca_pem)
        if self._restored.pop(name, None) == files:
            log.info("certificate files in %s are already current; not rewritten", directory)
            self._written[name] = versions
            return
        try:
            write_generation(directory, files, self._clock.now())
        except OSError as exc:
            # The in-memory secret (SDS) stays correct; the files catch up on the next change.
            log.error("could not write certificates to %s: %s", directory, exc)
            return
        self._written[name] = versions
        self.writes += 1
        log.info("wrote certificate files to %s", directory)
