"""Secrets read from files and kept fresh: `FILE_MOUNTED_CERTS` mode and `file-cert:`/`file-root:`.

Two users, one mechanism:

- `FileMountedSource` (Istio's `FILE_MOUNTED_CERTS=true`): the pod's certificate, key and root
  come from files (default `./etc/certs/{cert-chain,key,root-cert}.pem`, usually a mounted
  Kubernetes Secret) instead of from the CA; they are published into the agent's `SecretCache`
  as `default` and `ROOTCA`. Or, for Kubernetes Pod Certificates, the kubelet's one-file
  `podCertificate` credential bundle (`agent.credential_bundle`: PKCS#8 key, then the chain)
  with the pod's `clusterTrustBundle` projection as the root; no CSR, no token, no CA.
- `FileSecretProvider`: Envoy may ask SDS for `file-cert:<cert-path>~<key-path>` or
  `file-root:<ca-path>`; the provider loads and watches those files for as long as some stream
  wants them (plug it into `agent.sds.SecretResolver`).

Watching: `watchdog` observes the *directories* holding the files, never the files themselves.
The kubelet updates a mounted Secret by writing a new hidden directory and atomically renaming
the `..data` symlink beside the files; a watch on a file's inode would miss that (Istio's
"not updated after the second rotation" bug), a watch on the directory sees the rename. Events
arrive on watchdog's observer thread and hop to the asyncio loop with `call_soon_threadsafe`;
a short debounce lets a burst (certificate then key) settle before the files are re-read. A slow
periodic resync backs the watcher up.

Refusal: a set of files whose certificate does not parse or that `agent.acceptance` refuses
(outside its validity window, or not matching its key; any identity; a credential bundle's
chain must also verify to its trust bundle and name one SPIFFE ID) is refused: the previous
secret stays published, the reason is logged (never key material) and
`file_reload_failures{resource_name}` is counted.

Hostile names: a `file-*:` name comes from whoever can reach the SDS socket. Paths must lie
inside the allowed directories (`allowed_dirs`, resolved, so `..` and symlinks cannot leave
them); only regular files are read (a FIFO would block `open()` forever, `/dev/zero` never
ends), at most `MAX_FILE_BYTES` each (`meshca.safe_read`).

Concurrency: everything except the observer thread runs on the agent's asyncio loop. Loading
(read + parse) runs in a worker thread under `read_timeout`, so a stuck mount or a special file
never blocks the loop that serves every other SDS client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from agent.acceptance import accept_certificate
from agent.credential_bundle import MAX_CREDENTIAL_BUNDLE_BYTES, parse_credential_bundle
from agent.errors import CertificateRefused, FileSecretError, UnknownFileResourceError
from agent.metrics import LabeledCounter
from agent.secrets import (
    DEFAULT_RESOURCE,
    FILE_CERT_PREFIX,
    FILE_ROOT_PREFIX,
    ROOT_RESOURCE,
    RootSecret,
    Secret,
    SecretCache,
    TlsSecret,
    not_after,
)
from certs import CertsError, describe_certificate, load_certs, load_private_key
from meshca.clock import Clock
from meshca.safe_read import UnsafeFileError, path_is_within, read_regular_file
from meshca.waiting import cancel_and_wait, result_within

if TYPE_CHECKING:
    # Imported for real only when the first file is watched (`FileWatcher.start`): an agent
    # that never serves files does not load watchdog at all.
    from watchdog.events import FileSystemEvent, FileSystemEventHandler
    from watchdog.observers.api import BaseObserver, ObservedWatch

log = logging.getLogger(__name__)

DEFAULT_CERT_PATH = Path("./etc/certs/cert-chain.pem")
DEFAULT_KEY_PATH = Path("./etc/certs/key.pem")
DEFAULT_ROOT_PATH = Path("./etc/certs/root-cert.pem")
DEFAULT_DEBOUNCE = 0.1
DEFAULT_RESYNC_INTERVAL = 60.0
DEFAULT_READ_TIMEOUT = 5.0
MAX_FILE_BYTES = 1024 * 1024

# watchdog also reports reads (opened / closed without writing); those are our own re-reads.
_CHANGE_EVENTS = frozenset({"created", "deleted", "modified", "moved", "closed"})


class FileMetrics(Protocol):
    """The part of the agent's metrics file reloading writes (label `resource_name`)."""

    @property
    def file_reload_failures(self) -> LabeledCounter: ...


# --- loading ---------------------------------------------------------------------------------


def _read(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    try:
        return read_regular_file(path, limit)
    except UnsafeFileError as exc:
        raise FileSecretError(f"refusing {what}: {exc}") from exc
    except OSError as exc:
        raise FileSecretError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _pem_text(data: bytes, path: Path) -> str:
    """PEM is ASCII; anything else around the blocks is refused rather than crashing a reload."""
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise FileSecretError(f"{path} is not a PEM text file (it has non-ASCII bytes)") from None


def load_tls_secret(name: str, cert_path: Path, key_path: Path, *, now: datetime) -> TlsSecret:
    """Reads and checks a certificate chain and its key; `FileSecretError` says what is wrong."""
    cert_bytes = _read(cert_path, "certificate chain")
    if b"PRIVATE KEY-----" in cert_bytes:  # the chain goes to Envoy's config (and config_dump)
        raise FileSecretError(
            f"certificate chain {cert_path} holds a private key, which would be served as part "
            "of the chain; keep the key in its own file (for the kubelet's podCertificate "
            "bundle, key then chain in one file, use --credential-bundle)"
        )
    key_bytes = _read(key_path, "private key")
    try:
        chain = load_certs(cert_bytes, what=f"certificate chain {cert_path}")
        key = load_private_key(key_bytes)
    except CertsError as exc:
        raise FileSecretError(f"{exc} (key file {key_path})") from exc
    try:
        accept_certificate(chain, key, now=now)  # any identity: the operator chose the files
    except CertificateRefused as exc:
        raise FileSecretError(f"{cert_path} with key {key_path}: {exc}") from None
    return TlsSecret(
        name=name,
        cert_chain_pem=_pem_text(cert_bytes, cert_path),
        private_key_pem=_pem_text(key_bytes, key_path),
    )


def load_root_secret(name: str, ca_path: Path, *, now: datetime) -> RootSecret:
    """Reads and checks a trust bundle: it must parse and hold at least one unexpired cert."""
    data = _read(ca_path, "trust bundle")
    try:
        roots = load_certs(data, what=f"trust bundle {ca_path}")
    except CertsError as exc:
        raise FileSecretError(str(exc)) from exc
    if all(root.not_valid_after_utc <= now for root in roots):
        raise FileSecretError(f"every certificate in the trust bundle {ca_path} has expired")
    return RootSecret(name=name, trusted_ca_pem=_pem_text(data, ca_path))


def load_credential_bundle_secret(
    name: str, bundle_path: Path, root_path: Path, *, now: datetime
) -> TlsSecret:
    """The kubelet's `podCertificate` credential bundle (`agent.credential_bundle`), served only
    if its chain verifies to the trust bundle at `root_path` (the pod's `clusterTrustBundle`
    projection): the kubelet wrote both, and a leaf the pod's own roots do not trust would fail
    every handshake its peers check the same way. The leaf must carry one SPIFFE ID, the
    identity the Workload API reports."""
    data = _read(bundle_path, "credential bundle", MAX_CREDENTIAL_BUNDLE_BYTES)
    bundle = parse_credential_bundle(data, source=str(bundle_path))
    roots_data = _read(root_path, "trust bundle")
    try:
        roots = load_certs(roots_data, what=f"trust bundle {root_path}")
    except CertsError as exc:
        raise FileSecretError(str(exc)) from None
    try:
        uris = describe_certificate(bundle.leaf).uri_sans
    except CertsError as exc:
        raise FileSecretError(f"credential bundle {bundle_path}: the leaf: {exc}") from None
    if len(uris) != 1 or not uris[0].startswith("spiffe://"):
        raise FileSecretError(
            f"credential bundle {bundle_path}: the leaf's URI SANs are {list(uris)}, not one "
            "SPIFFE ID; the signer must issue the pod's SPIFFE identity"
        )
    try:
        accept_certificate(bundle.chain, bundle.key, now=now, roots=roots)
    except CertificateRefused as exc:
        raise FileSecretError(
            f"credential bundle {bundle_path} (trust bundle {root_path}): {exc}"
        ) from None
    return TlsSecret(name=name, cert_chain_pem=bundle.chain_pem, private_key_pem=bundle.key_pem)


@dataclass(frozen=True)
class FileResource:
    """One file-backed secret: a parsed `file-cert:` or `file-root:` name, or one of the
    file-mounted mode's two (`FileMountedSource`). A change in any of `paths`' directories
    reloads it."""

    name: str
    paths: tuple[Path, ...]  # (cert, key) or (ca,); with `credential_bundle`: (bundle, ca)
    credential_bundle: bool = False

    @classmethod
    def parse(cls, name: str) -> FileResource:
        if name.startswith(FILE_CERT_PREFIX):
            parts = name[len(FILE_CERT_PREFIX) :].split("~")
            if len(parts) != 2 or not all(parts):
                raise UnknownFileResourceError(
                    f"resource {name!r}: expected file-cert:<cert-path>~<key-path>"
                )
            return cls(name, (Path(parts[0]), Path(parts[1])))
        if name.startswith(FILE_ROOT_PREFIX):
            path = name[len(FILE_ROOT_PREFIX) :]
            if not path:
                raise UnknownFileResourceError(f"resource {name!r}: expected file-root:<ca-path>")
            return cls(name, (Path(path),))
        raise UnknownFileResourceError(f"resource {name!r} is not a file-cert: or file-root: name")

    def load(self, now: datetime) -> Secret:
        if self.credential_bundle:
            bundle, roots = self.paths
            return load_credential_bundle_secret(self.name, bundle, roots, now=now)
        if len(self.paths) == 2:
            return load_tls_secret(self.name, self.paths[0], self.paths[1], now=now)
        return load_root_secret(self.name, self.paths[0], now=now)


# --- watching --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Watched:
    """One secret backed by files, published into `cache` under `resource.name`."""

    resource: FileResource
    cache: SecretCache
    users: int = 0
    timer: asyncio.TimerHandle | None = None
    last_error: str | None = None
    directories: tuple[str, ...] = field(default=())
    # The read in a worker thread; one at a time, so a stuck mount holds one thread, not one
    # per resync (a thread blocked in a system call cannot be cancelled).
    reading: asyncio.Future[Secret] | None = None


class _DirectoryEvents:
    """Runs on watchdog's thread: forwards a change in `directory` to the asyncio loop.

    watchdog's observer only calls `dispatch(event)` on a handler, so this needs no base class
    from watchdog (which keeps the module importable without loading watchdog).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        directory: str,
        callback: Callable[[str], None],
    ) -> None:
        self._loop = loop
        self._directory = directory
        self._callback = callback

    def dispatch(self, event: FileSystemEvent) -> None:
        if event.event_type not in _CHANGE_EVENTS:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._loop.call_soon_threadsafe(self._callback, self._directory)


class FileWatcher:
    """Keeps file-backed secrets published: loads them, watches their directories, reloads."""

    def __init__(
        self,
        *,
        clock: Clock,
        metrics: FileMetrics | None = None,
        debounce: float = DEFAULT_DEBOUNCE,
        resync_interval: float = DEFAULT_RESYNC_INTERVAL,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        self.clock = clock
        self.metrics = metrics
        self.debounce = debounce
        self.resync_interval = resync_interval
        self.read_timeout = read_timeout
        self.failures = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._observer: BaseObserver | None = None
        self._watched: dict[str, _Watched] = {}
        self._directories: dict[str, ObservedWatch] = {}
        self._resync: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._observer is not None:
            return
        from watchdog.observers import Observer

        self._loop = asyncio.get_running_loop()
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.start()
        self._resync = asyncio.create_task(self._resync_forever())

    async def stop(self) -> None:
        resync, self._resync = self._resync, None
        await cancel_and_wait(resync)
        for watched in self._watched.values():
            if watched.timer is not None:
                watched.timer.cancel()
        self._watched.clear()
        self._directories.clear()
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            await asyncio.to_thread(observer.join, 5)

    def last_error(self, name: str) -> str | None:
        watched = self._watched.get(name)
        return watched.last_error if watched else None

    async def add(self, resource: FileResource, cache: SecretCache) -> None:
        """Starts keeping `resource` published in `cache` (reference-counted by name)."""
        self.start()
        watched = self._watched.get(resource.name)
        if watched is None:
            directories = tuple(
                sorted({os.path.dirname(os.path.abspath(p)) for p in resource.paths})
            )
            watched = _Watched(resource, cache, directories=directories)
            self._watched[resource.name] = watched
            for directory in directories:
                self._watch_directory(directory)
            await self._reload(watched)
        watched.users += 1

    def remove(self, name: str) -> bool:
        """Drops one user of `name`; True when that was the last one and watching stopped."""
        watched = self._watched.get(name)
        if watched is None:
            return False
        watched.users -= 1
        if watched.users > 0:
            return False
        del self._watched[name]
        if watched.timer is not None:
            watched.timer.cancel()
        still_needed = {d for w in self._watched.values() for d in w.directories}
        for directory in watched.directories:
            if directory not in still_needed:
                observed = self._directories.pop(directory, None)
                if observed is not None and self._observer is not None:
                    self._observer.unschedule(observed)
        return True

    def _watch_directory(self, directory: str) -> None:
        if directory in self._directories or self._observer is None or self._loop is None:
            return
        handler = _DirectoryEvents(self._loop, directory, self._on_directory_changed)
        try:
            # Duck-typed: the observer only ever calls `handler.dispatch(event)`.
            as_handler = cast("FileSystemEventHandler", handler)
            self._directories[directory] = self._observer.schedule(as_handler, directory)
        except OSError as exc:
            log.warning(
                "cannot watch %s (%s); changes there are picked up only by the %ss resync",
                directory,
                exc,
                self.resync_interval,
            )

    def _on_directory_changed(self, directory: str) -> None:
        assert self._loop is not None
        for watched in self._watched.values():
            if directory not in watched.directories:
                continue
            if watched.timer is not None:
                watched.timer.cancel()
            watched.timer = self._loop.call_later(self.debounce, self._schedule_reload, watched)

    def _schedule_reload(self, watched: _Watched) -> None:
        watched.timer = None
        if self._watched.get(watched.resource.name) is watched:
            asyncio.create_task(self._reload(watched))  # noqa: RUF006 - short, self-contained

    async def _reload(self, watched: _Watched) -> None:
        name = watched.resource.name
        paths = ", ".join(str(p) for p in watched.resource.paths)
        if watched.reading is not None and not watched.reading.done():
            self._refuse(watched, f"the previous read of {paths} has still not finished")
            return
        watched.reading = asyncio.ensure_future(
            asyncio.to_thread(watched.resource.load, self.clock.now())
        )
        try:
            secret = await result_within(watched.reading, self.read_timeout)
        except FileSecretError as exc:
            self._refuse(watched, str(exc))
            return
        except TimeoutError:
            self._refuse(watched, f"reading {paths} did not finish within {self.read_timeout:g}s")
            return
        watched.last_error = None
        if self.metrics is not None:
            # At 0 from the first load, so Prometheus's increase() counts the first refusal.
            self.metrics.file_reload_failures.labels(resource_name=name)
        if await watched.cache.publish(secret):
            log.info(
                "loaded %s from %s (version %s)",
                name,
                ", ".join(str(p) for p in watched.resource.paths),
                secret.version,
            )

    def _refuse(self, watched: _Watched, reason: str) -> None:
        name = watched.resource.name
        watched.last_error = reason
        self.failures += 1
        if self.metrics is not None:
            self.metrics.file_reload_failures.labels(resource_name=name).inc()
        kept = "keeping the previous version" if watched.cache.get(name) else "nothing to serve"
        log.warning("refusing %s: %s; %s", name, reason, kept)

    async def _resync_forever(self) -> None:
        while True:
            await self.clock.sleep(self.resync_interval)
            for watched in list(self._watched.values()):
                await self._reload(watched)


class FileMountedSource:
    """`FILE_MOUNTED_CERTS` mode: publishes `default` and `ROOTCA` from files into `cache`
    (an `agent.certificate_source.CertificateSource`).

    `await start()` loads the files once (a failure is logged and counted, and the files keep
    being watched so a later fix is picked up) and watches them; `await stop()` stops watching.

    With `credential_bundle` (the kubelet's `podCertificate` bundle: key, then chain) the
    certificate and key come from that one file instead of `cert_path` and `key_path`, and
    are served only while the chain verifies to `root_path` (reloaded when either changes).
    """

    def __init__(
        self,
        cache: SecretCache,
        watcher: FileWatcher,
        cert_path: str | os.PathLike[str] = DEFAULT_CERT_PATH,
        key_path: str | os.PathLike[str] = DEFAULT_KEY_PATH,
        root_path: str | os.PathLike[str] = DEFAULT_ROOT_PATH,
        *,
        credential_bundle: str | os.PathLike[str] | None = None,
        cert_name: str = DEFAULT_RESOURCE,
        root_name: str = ROOT_RESOURCE,
    ) -> None:
        self.cache = cache
        self.watcher = watcher
        if credential_bundle is None:
            leaf = FileResource(cert_name, (Path(cert_path), Path(key_path)))
        else:
            paths = (Path(credential_bundle), Path(root_path))
            leaf = FileResource(cert_name, paths, credential_bundle=True)
        self._resources = (leaf, FileResource(root_name, (Path(root_path),)))

    async def start(self) -> None:
        for resource in self._resources:
            await self.watcher.add(resource, self.cache)

    async def run(self) -> None:
        """Nothing to do between file events (the watcher reacts to them): waits until
        cancelled, as the Agent's certificate worker."""
        await asyncio.Event().wait()

    async def stop(self) -> None:
        await self.watcher.stop()

    async def close(self) -> None:
        await self.stop()

    @property
    def ready(self) -> bool:
        """True once both secrets have been published."""
        return all(self.cache.get(resource.name) for resource in self._resources)

    def has_valid_certificate(self, now: datetime | None = None) -> bool:
        """Readiness: both secrets held and the certificate not expired (`agent.status`)."""
        secret = self.cache.get(self._resources[0].name)
        if not self.ready or secret is None:
            return False
        return not_after(secret) > (now or self.watcher.clock.now())

    # No pods behind mounted files (node mode excludes FILE_MOUNTED_CERTS).
    pods = None
    jwt_svids = None  # no CA: no JWT-SVIDs

    @property
    def last_error(self) -> str | None:
        """Why the files were last refused, if they were."""
        errors = [self.watcher.last_error(resource.name) for resource in self._resources]
        return "; ".join(error for error in errors if error) or None


class FileSecretProvider:
    """Serves `file-cert:`/`file-root:` names on demand (`agent.sds.SecretResolver(files=...)`).

    Files are loaded and watched while at least one `updates(name)` iterator is open; when the
    last one closes, the secret leaves `cache` too (its removal listeners, e.g. the expiry
    metric, hear of it), so nothing is reported for files no one serves any more.
    """

    def __init__(
        self,
        watcher: FileWatcher,
        *,
        allowed_dirs: tuple[Path, ...] | None = None,
        forbidden_dirs: tuple[Path, ...] = (),
    ) -> None:
        """`allowed_dirs`: where `file-*:` paths may point (`None`: anywhere, for tests and
        embedding; the agent always passes its configured list). `forbidden_dirs` are refused
        even inside an allowed one: the agent's own output directory, which in node mode holds
        every identity's private key."""
        self.cache = SecretCache()
        self.watcher = watcher
        self.allowed_dirs = allowed_dirs
        self.forbidden_dirs = forbidden_dirs

    def updates(self, name: str) -> AsyncIterator[Secret]:
        """The secret for a `file-*:` name, then each accepted change. Malformed names, and
        paths outside the allowed directories, raise `UnknownFileResourceError` (a
        `ValueError`) right away."""
        resource = FileResource.parse(name)
        for path in resource.paths:
            self._check_allowed(path)
        return self._follow(resource)

    def _check_allowed(self, path: Path) -> None:
        if not path.is_absolute():
            raise UnknownFileResourceError(
                f"{FILE_CERT_PREFIX}/{FILE_ROOT_PREFIX} paths must be absolute (got {path})"
            )
        if self.forbidden_dirs and path_is_within(path, self.forbidden_dirs):
            raise UnknownFileResourceError(
                f"{path} is inside the agent's own output directory, which is never served "
                "by file-cert:/file-root:"
            )
        if self.allowed_dirs is not None and not path_is_within(path, self.allowed_dirs):
            allowed = ":".join(str(d) for d in self.allowed_dirs) or "(none)"
            raise UnknownFileResourceError(
                f"{path} is outside the directories allowed for file-cert:/file-root: "
                f"({allowed}); add its directory with --file-secret-dirs or "
                "FILE_SECRET_DIRS"
            )

    async def _follow(self, resource: FileResource) -> AsyncIterator[Secret]:
        await self.watcher.add(resource, self.cache)
        try:
            async for secret in self.cache.updates(resource.name):
                yield secret
        finally:
            if self.watcher.remove(resource.name):
                await self.cache.remove(resource.name)

    async def stop(self) -> None:
        await self.watcher.stop()
