"""What an identity source is: the protocol every source implements and the snapshot it reports.

Below its users, so that neither kind of source imports the other for it: the pod agent's
`agent.identity_sources.SingleIdentitySource`, node mode's `agent.node_identities` sources, the
one choice (`agent.identity_sources.identity_source_for`) and the consumer,
`agent.scheduler.CertificateScheduler.set_identities`, all build on this module alone.

A source reports the *whole* current set of identities (an `IdentitySet` snapshot) every time
it changes, always on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from certs import SpiffeId

IdentitySet = frozenset[SpiffeId]
OnChange = Callable[[IdentitySet], None]
"""What a source reports to: the scheduler's `set_identities`."""


class IdentitySource(Protocol):
    """Reports the identities to serve; `on_change` is always called on the event loop."""

    def start(self, on_change: OnChange) -> None: ...

    async def stop(self) -> None: ...

    def describe(self) -> str: ...
