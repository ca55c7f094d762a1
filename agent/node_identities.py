"""Where the node agent learns which identities to serve: pods on its node, or a static list.

An `IdentitySource` reports the *whole* current set of identities (a snapshot) every time it
changes; the consumer (`agent.scheduler.CertificateScheduler.set_identities`) reconciles. Full
snapshots make a re-list after a lost watch trivially correct: there is no add/remove delta to
get wrong.

- `StaticIdentitySource`: `--identities ns/sa,...` and/or `--identities-file PATH`, reported
  once at start. No API server involved.
- `PodIdentitySource`: pods with `spec.nodeName=<node>` through the official `kubernetes`
  client: list, then watch from the list's resourceVersion; a 410 Gone (history compacted) or a
  broken connection re-lists. An identity (namespace, service account) exists while at least one
  of its pods is on the node and not finished (phases Succeeded/Failed are ignored, like
  ztunnel).

`identity_source_for(config)` is the one place that chooses between them.

Concurrency model: the `kubernetes` client is synchronous, so `PodIdentitySource` runs its
list/watch loop on one daemon thread. That thread owns the `PodIndex` (no locks); whenever the
set of identities changes it hands an immutable `frozenset` to the event loop with
`loop.call_soon_threadsafe(on_change, snapshot)`, so `on_change` always runs on the loop.
`stop()` sets a flag and shuts the watch's socket down (`Watch.stop()`), which ends a blocked
read at once; the thread is then joined (bounded) from a worker thread so the loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.backoff import Backoff
from agent.config import AgentConfig, ConfigError, parse_identities
from certs import SpiffeId, SpiffeIdError

log = logging.getLogger(__name__)

IdentitySet = frozenset[SpiffeId]
OnChange = Callable[[IdentitySet], None]

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
HTTP_GONE = 410
RELIST_BACKOFF = Backoff(initial=0.5, multiplier=2.0, maximum=30.0, jitter=0.5)


class IdentitySource(Protocol):
    """Reports the identities to serve; `on_change` is always called on the event loop."""

    def start(self, on_change: OnChange) -> None: ...

    async def stop(self) -> None: ...

    def describe(self) -> str: ...


# --- static list -----------------------------------------------------------------------------


class StaticIdentitySource:
    """A fixed list of identities (flags and/or a file), for nodes without an API server."""

    def __init__(
        self, trust_domain: str, pairs: Iterable[tuple[str, str]], file: Path | None = None
    ) -> None:
        self._trust_domain = trust_domain
        self._pairs = tuple(pairs)
        self._file = file

    def identities(self) -> IdentitySet:
        """The configured identities; `ConfigError` names the bad entry or unreadable file."""
        pairs = list(self._pairs)
        if self._file is not None:
            try:
                text = self._file.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(
                    f"--identities-file {self._file} cannot be read: {exc.strerror}"
                ) from None
            pairs.extend(parse_identities(text, f"--identities-file {self._file}"))
        result = set()
        for namespace, account in pairs:
            try:
                result.add(SpiffeId(self._trust_domain, namespace, account))
            except SpiffeIdError as exc:
                raise ConfigError(f"static identity {namespace}/{account}: {exc}") from None
        return frozenset(result)

    def start(self, on_change: OnChange) -> None:
        on_change(self.identities())

    async def stop(self) -> None:
        return None

    def describe(self) -> str:
        where = f" and {self._file}" if self._file is not None else ""
        return f"static identity list (flags{where})"


# --- pods on this node -----------------------------------------------------------------------


@dataclass(frozen=True)
class PodRef:
    """What the index keeps of a pod: where it is and which identity it runs as."""

    namespace: str
    name: str
    service_account: str


class PodIndex:
    """The live pods on the node, by (namespace, name), and the identities they make up.

    Pure and single-threaded: fed `kubernetes` model objects (`V1Pod`), returns whether the set
    of identities changed so the caller only reports real changes.
    """

    def __init__(self, trust_domain: str) -> None:
        self._trust_domain = trust_domain
        self._pods: dict[tuple[str, str], PodRef] = {}
        self._identities: IdentitySet = frozenset()

    @property
    def identities(self) -> IdentitySet:
        return self._identities

    def replace(self, pods: Iterable[Any]) -> bool:
        """A fresh list: forget everything else."""
        self._pods = {}
        for pod in pods:
            ref = self._ref(pod)
            if ref is not None and _is_live(pod):
                self._pods[(ref.namespace, ref.name)] = ref
        return self._recompute()

    def apply(self, event_type: str, pod: Any) -> bool:
        """One watch event (ADDED, MODIFIED, DELETED; BOOKMARK and others are no-ops)."""
        ref = self._ref(pod)
        if ref is None:
            return False
        key = (ref.namespace, ref.name)
        if event_type in ("ADDED", "MODIFIED") and _is_live(pod):
            self._pods[key] = ref
        elif event_type in ("ADDED", "MODIFIED", "DELETED"):
            self._pods.pop(key, None)
        else:
            return False
        return self._recompute()

    def _ref(self, pod: Any) -> PodRef | None:
        metadata = getattr(pod, "metadata", None)
        spec = getattr(pod, "spec", None)
        if metadata is None or spec is None or not metadata.namespace or not metadata.name:
            return None
        account = spec.service_account_name or "default"
        return PodRef(metadata.namespace, metadata.name, account)

    def _recompute(self) -> bool:
        identities = set()
        for ref in self._pods.values():
            try:
                identities.add(SpiffeId(self._trust_domain, ref.namespace, ref.service_account))
            except SpiffeIdError as exc:
                log.warning("pod %s/%s: unusable identity: %s", ref.namespace, ref.name, exc)
        snapshot = frozenset(identities)
        changed = snapshot != self._identities
        self._identities = snapshot
        return changed


def _is_live(pod: Any) -> bool:
    status = getattr(pod, "status", None)
    phase = getattr(status, "phase", None) if status is not None else None
    return phase not in TERMINAL_PHASES


class PodIdentitySource:
    """Watches the pods on `node_name` with the `kubernetes` client (see the module docstring).

    `api_client_factory` builds a `kubernetes.client.ApiClient` (from a kubeconfig or the
    in-cluster service account); it is called on the watch thread, and again with backoff until
    it succeeds. Watches last
    `watch_timeout_seconds` and then resume from the last resourceVersion seen (advanced by
    bookmarks, when `bookmarks`, so a quiet node does not fall behind compaction).
    """

    def __init__(
        self,
        node_name: str,
        trust_domain: str,
        api_client_factory: Callable[[], Any],
        *,
        watch_timeout_seconds: int = 300,
        request_timeout_seconds: float = 30.0,
        bookmarks: bool = True,
        backoff: Backoff = RELIST_BACKOFF,
    ) -> None:
        self.node_name = node_name
        self._factory = api_client_factory
        self._index = PodIndex(trust_domain)
        self._watch_timeout = watch_timeout_seconds
        self._request_timeout = request_timeout_seconds
        self._bookmarks = bookmarks
        self._backoff = backoff
        self._rng = random.Random()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: OnChange | None = None
        self.lists = 0  # full lists done (1 + re-lists), for tests and logs

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node_name}"

    def describe(self) -> str:
        return f"pods on node {self.node_name} (Kubernetes API watch)"

    def start(self, on_change: OnChange) -> None:
        if self._thread is not None:
            raise RuntimeError("pod identity source already started")
        self._loop = asyncio.get_running_loop()
        self._on_change = on_change
        self._thread = threading.Thread(
            target=self._run, name=f"pod-watch-{self.node_name}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        watch = self._watch
        if watch is not None:
            watch.stop()  # shuts the socket down: a blocked read returns now
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 2.0)
            if thread.is_alive():
                log.warning("pod watch thread did not stop within 2s; abandoning it (daemon)")

    # -- the watch thread -----------------------------------------------------------------

    def _run(self) -> None:
        from kubernetes import client

        api: Any = None
        failures = 0
        while not self._stopping.is_set():
            try:
                if api is None:  # retried: in-cluster credentials may not be mounted yet
                    api = client.CoreV1Api(self._factory())
                version = self._list(api)
                failures = 0
                self._watch_from(api, version)
            except Exception as exc:
                if self._stopping.is_set():
                    break
                if getattr(exc, "status", None) == HTTP_GONE:
                    log.info("pod watch expired (410 Gone); re-listing pods on %s", self.node_name)
                    continue
                delay = self._backoff.delay(failures, self._rng)
                failures += 1
                log.warning(
                    "pod list/watch on node %s failed (%s); re-listing in %.1fs",
                    self.node_name,
                    _brief(exc),
                    delay,
                )
                self._stopping.wait(delay)
        log.debug("pod watch thread for %s stopped", self.node_name)

    def _list(self, api: Any) -> str:
        pods = api.list_pod_for_all_namespaces(
            field_selector=self.selector, _request_timeout=self._request_timeout
        )
        self.lists += 1
        changed = self._index.replace(pods.items or [])
        if changed or self.lists == 1:  # the first list is reported even when empty (synced)
            self._report()
        version: str = pods.metadata.resource_version
        log.info(
            "listed %d pod(s) on node %s: %d identities (resourceVersion %s)",
            len(pods.items or []),
            self.node_name,
            len(self._index.identities),
            version,
        )
        return version

    def _watch_from(self, api: Any, version: str) -> None:
        from kubernetes import watch

        while not self._stopping.is_set():
            self._watch = watch.Watch()
            stream = self._watch.stream(
                api.list_pod_for_all_namespaces,
                field_selector=self.selector,
                resource_version=version,
                timeout_seconds=self._watch_timeout,
                allow_watch_bookmarks=self._bookmarks,
            )
            for event in stream:
                if self._stopping.is_set():
                    return
                if self._index.apply(event["type"], event["object"]):
                    self._report()
            # The server ended the watch (timeout): resume where it left off.
            version = self._watch.resource_version or version

    def _report(self) -> None:
        loop, on_change = self._loop, self._on_change
        if loop is None or on_change is None or self._stopping.is_set():
            return
        snapshot = self._index.identities
        with contextlib.suppress(RuntimeError):  # the loop closed under us: shutting down
            loop.call_soon_threadsafe(on_change, snapshot)


def _brief(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return str(exc) or type(exc).__name__


# --- choosing --------------------------------------------------------------------------------


def kube_api_client_factory(config: AgentConfig) -> Callable[[], Any]:
    """An `ApiClient` from `--kubeconfig`/KUBECONFIG, else in-cluster credentials."""

    def build() -> Any:
        from kubernetes import client
        from kubernetes import config as kube_config

        if config.kubeconfig is not None:
            return kube_config.new_client_from_config(config_file=str(config.kubeconfig))
        configuration = client.Configuration()
        kube_config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)

    return build


def identity_source_for(config: AgentConfig) -> IdentitySource:
    """The one place node mode picks its identity source: a static list when one is configured
    (no API server needed), else the pods on `config.node_name`."""
    if config.static_identities:
        return StaticIdentitySource(config.trust_domain, config.identities, config.identities_file)
    if not config.node_name:
        raise ConfigError("--node-mode watching pods needs --node-name or NODE_NAME")
    return PodIdentitySource(config.node_name, config.trust_domain, kube_api_client_factory(config))
