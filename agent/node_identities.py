"""The node agent's identity sources: pods on its node, or a static list.

Both are `agent.identity_source.IdentitySource`s (full snapshots, `on_change` on the loop);
`agent.identity_sources.identity_source_for` chooses between them and the pod agent's
`SingleIdentitySource`, and imports this module only in node mode.

- `StaticIdentitySource`: `--identities ns/sa,...` and/or `--identities-file PATH`, reported
  once at start. No API server involved.
- `PodIdentitySource`: pods with `spec.nodeName=<node>`, watched by the shared informer
  (`meshca.informer`, the CA's too) and indexed by node: list, then watch from the list's
  resourceVersion; a 410 Gone (history compacted) or a broken connection re-lists. An identity
  (namespace, service account) exists while at least one of its pods on the node is live — the
  one rule in `meshca.pods`: a pod counts until it is terminal (Succeeded/Failed) or deleted.

Concurrency model: the `kubernetes` client is synchronous, so the informer runs its list/watch
loop on one daemon thread. After every change it calls back on that thread; the source then
recomputes the node's identities from the informer's index and, when they changed, hands an
immutable `frozenset` to the event loop with `loop.call_soon_threadsafe(on_change, snapshot)`,
so `on_change` always runs on the loop. `stop()` ends a watch at once (its socket is shut down)
and abandons a pod list in flight (its answer is discarded); the thread is joined (bounded,
never for an abandoned list) from a worker thread so the loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.backoff import Backoff
from agent.config import AgentConfig, ConfigError, parse_identities
from agent.identity_source import IdentitySet, OnChange
from certs import SpiffeId, SpiffeIdError
from meshca.pods import BY_NODE, BY_UID, PodInfo, node_of, pod_info, uid_of

if TYPE_CHECKING:
    from meshca.informer import Informer

log = logging.getLogger(__name__)

RELIST_BACKOFF = Backoff(initial=0.5, multiplier=2.0, maximum=30.0, jitter=0.5)


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


def identities_of(pods: Iterable[PodInfo], trust_domain: str) -> IdentitySet:
    """The identities the live pods make up (`meshca.pods`: a pod counts until it is terminal
    or deleted); a pod whose names make no valid SPIFFE ID is logged and skipped."""
    identities = set()
    for pod in pods:
        if not pod.live:
            continue
        try:
            identities.add(SpiffeId(trust_domain, pod.namespace, pod.service_account))
        except SpiffeIdError as exc:
            log.warning("pod %s/%s: unusable identity: %s", pod.namespace, pod.name, exc)
    return frozenset(identities)


class PodIdentitySource:
    """Watches the pods on `node_name` with `meshca.informer` (see the module docstring).

    `api_client_factory` builds a `kubernetes.client.ApiClient` (from a kubeconfig or the
    in-cluster service account); it is called on the watch thread, and again with backoff until
    it succeeds. Watches last `watch_timeout_seconds` and then resume from the last
    resourceVersion seen (advanced by bookmarks, when `bookmarks`, so a quiet node does not fall
    behind compaction).
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
        self._trust_domain = trust_domain
        self._factory = api_client_factory
        rng = random.Random()
        self._watch_options: dict[str, Any] = {
            "watch_seconds": watch_timeout_seconds,
            "request_timeout": request_timeout_seconds,
            "bookmarks": bookmarks,
            "backoff": lambda failures: backoff.delay(failures, rng),
        }
        self._informer: Informer[PodInfo] | None = None
        self._reported: IdentitySet | None = None  # last snapshot handed over (watch thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: OnChange | None = None

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node_name}"

    @property
    def lists(self) -> int:
        """Full lists done (1 + re-lists), for tests and logs."""
        return self._informer.lists if self._informer is not None else 0

    @property
    def watching(self) -> bool:
        """Started, not stopped, and its watch thread still runs."""
        return self._informer is not None and self._informer.alive

    def describe(self) -> str:
        return f"pods on node {self.node_name} (Kubernetes API watch)"

    def start(self, on_change: OnChange) -> None:
        from meshca.informer import Informer  # imports `kubernetes`: only when watching pods

        if self._informer is not None:
            raise RuntimeError("pod identity source already started")
        self._loop = asyncio.get_running_loop()
        self._on_change = on_change
        self._informer = Informer(
            f"pods-on-{self.node_name}",
            None,
            pod_info,
            connect=self._connect,
            list_kwargs={"field_selector": self.selector},
            indexers={BY_NODE: node_of, BY_UID: uid_of},
            on_change=self._changed,
            on_restart=self._restarted,
            **self._watch_options,
        )
        self._informer.start()

    def pod_by_uid(self, uid: str) -> PodInfo | None:
        """The pod on this node with `uid` (any thread; the informer's index is locked): how the
        Workload API places a caller (`agent.workload.attestor`)."""
        informer = self._informer
        if informer is None:
            return None
        pods = informer.by_index(BY_UID, uid)
        return pods[0] if len(pods) == 1 else None

    async def stop(self) -> None:
        """Ends the watch now; a pod list in flight is abandoned, not waited for."""
        informer, self._informer = self._informer, None
        if informer is None:
            return
        informer.stop()
        if not await asyncio.to_thread(informer.join, 2.0):
            log.warning("pod watch thread did not stop within 2s; abandoning it (daemon)")

    # -- the watch thread -----------------------------------------------------------------

    def _connect(self) -> Callable[..., Any]:
        from kubernetes import client

        return client.CoreV1Api(self._factory()).list_pod_for_all_namespaces

    def _changed(self) -> None:
        informer, loop, on_change = self._informer, self._loop, self._on_change
        if informer is None or loop is None or on_change is None:
            return
        snapshot = identities_of(informer.by_index(BY_NODE, self.node_name), self._trust_domain)
        if snapshot == self._reported:  # the first list is reported even when empty (synced)
            return
        self._reported = snapshot
        with contextlib.suppress(RuntimeError):  # the loop closed under us: shutting down
            loop.call_soon_threadsafe(on_change, snapshot)

    def _restarted(self, cause: str) -> None:
        # Failures are logged by the informer with their HTTP status; an expiry is routine.
        if cause == "expired":
            log.info("pod watch expired (410 Gone); re-listing pods on %s", self.node_name)


# --- the API client -------------------------------------------------------------------------------


def kube_api_client_factory(config: AgentConfig) -> Callable[[], Any]:
    """An `ApiClient` from `--kubeconfig`/KUBECONFIG, else in-cluster credentials, built by the
    one builder both daemons use (`meshca.kube_client`)."""

    def build() -> Any:
        from meshca.kube_client import build_api_client

        return build_api_client(
            config.kubeconfig, pool_size=4, user_agent=f"meshca-agent/{config.node_name or '-'}"
        )

    return build
