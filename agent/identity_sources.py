"""Where the scheduler learns which identities to serve: one `IdentitySource`, chosen once.

    IdentitySource (protocol)      start(on_change) · stop · describe (`agent.identity_source`)
    ├── SingleIdentitySource       pod agent (sidecar): its one identity, configured or read
    │                              from the service-account token (here)
    ├── StaticIdentitySource       node agent: `--identities` / `--identities-file`
    └── PodIdentitySource          node agent: the pods on its node, watched
                                   (both in `agent.node_identities`)

A source reports the *whole* current set of identities (a snapshot) every time it changes; the
consumer (`agent.scheduler.CertificateScheduler.set_identities`) reconciles. Full snapshots make
a re-list after a lost watch trivially correct: there is no add/remove delta to get wrong.

`identity_source_for(config, ...)` is the one place the choice is made. Node mode's sources are
imported only when node mode is chosen, so a pod agent never loads them (nor, through them, the
Kubernetes client).

Concurrency: `on_change` is always called on the event loop. `SingleIdentitySource` retries in
a task on the loop until the identity is known.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.backoff import Backoff
from agent.config import AgentConfig, ConfigError
from agent.errors import TokenError
from agent.identity_source import IdentitySource, OnChange
from agent.token import IdentityResolver, TokenProvider
from certs import SpiffeId
from meshca.clock import Clock
from meshca.waiting import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SingleIdentitySource:
    """The pod agent's identity source: one identity, the configured one or the token's.

    `resolve` (an `agent.token.IdentityResolver`) may fail until the kubelet writes the token;
    the source retries with `backoff` on `clock`, tells `on_failure` why (readiness shows it),
    and reports the identity once it is known.
    """

    resolve: Callable[[], SpiffeId]
    clock: Clock
    backoff: Backoff
    on_failure: Callable[[str], None] | None = None
    rng: random.Random = field(default_factory=random.Random)
    identity: SpiffeId | None = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def describe(self) -> str:
        return str(self.identity) if self.identity else "the service-account token"

    def start(self, on_change: OnChange) -> None:
        """Reports at once when the identity is known (so readiness never sees an unreported
        pod agent), else retries in a task until it is."""
        if not self._try_report(on_change):
            self._task = asyncio.create_task(self._retry(on_change), name="identity")

    def _try_report(self, on_change: OnChange) -> bool:
        try:
            identity = self.resolve()
        except (TokenError, ConfigError) as exc:
            log.warning("identity not known yet (%s); will retry", exc)
            if self.on_failure is not None:
                self.on_failure(str(exc))
            return False
        self.identity = identity
        on_change(frozenset({identity}))
        return True

    async def _retry(self, on_change: OnChange) -> None:
        attempt = 0
        while True:
            await self.clock.sleep(self.backoff.delay(attempt, self.rng))
            attempt += 1
            if self._try_report(on_change):
                return

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)


def identity_source_for(
    config: AgentConfig,
    tokens: TokenProvider,
    clock: Clock,
    backoff: Backoff,
    on_failure: Callable[[str], None],
) -> IdentitySource:
    """The agent's one identity source for `config`: in node mode a static list when one is
    configured (no API server needed), else the pods on `config.node_name`; otherwise the pod
    agent's one identity (`tokens`, `clock`, `backoff` and `on_failure` are for it)."""
    if not config.node_mode:
        resolve = IdentityResolver(config.identity, tokens, config.trust_domain)
        return SingleIdentitySource(resolve, clock, backoff, on_failure=on_failure)
    from agent.node_identities import (
        PodIdentitySource,
        StaticIdentitySource,
        kube_api_client_factory,
    )

    if config.static_identities:
        return StaticIdentitySource(config.trust_domain, config.identities, config.identities_file)
    if not config.node_name:
        raise ConfigError("--node-mode watching pods needs --node-name or NODE_NAME")
    return PodIdentitySource(config.node_name, config.trust_domain, kube_api_client_factory(config))
