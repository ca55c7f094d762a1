"""What the certificate scheduler (`agent.scheduler`) holds: each identity's state and the
queue of identities waiting for a fetch.

- `IdentityState`: everything known about one identity (its current certificate and
  generation, failures, the pending timer, the taints it was re-signed early for). Replaced,
  not reused, when the identity leaves and comes back, so a stale timer or fetch can tell.
- `FetchQueue`: pending work in two priority classes, `FIRST` (an identity with no
  certificate yet: it blocks a new pod) before `RENEWAL` (renewals have slack), FIFO within
  each; an identity is queued at most once.

The rules that act on them (when to renew, what a taint moves) are the scheduler's and
`agent.rotation`'s. Concurrency: used on the scheduler's event loop only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field
from datetime import datetime

from agent.rotation import FailureRecord
from agent.signing import SignedCertificate
from certs import SpiffeId

FIRST = 0  # priority classes: lower goes first
RENEWAL = 1


class FetchQueue:
    """Identities waiting for a fetch: priority class first (`FIRST` before `RENEWAL`), then
    FIFO. Each identity is in the queue at most once; re-queuing with a better class promotes
    it. `discard` forgets one (lazily: its heap entry is skipped when it surfaces)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, SpiffeId]] = []
        self._queued: dict[SpiffeId, tuple[int, int]] = {}  # identity -> (class, seq) live
        self._seq = itertools.count()
        self._nonempty = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, identity: object) -> bool:
        return identity in self._queued

    def put(self, identity: SpiffeId, priority: int) -> None:
        held = self._queued.get(identity)
        if held is not None and held[0] <= priority:
            return
        entry = (priority, next(self._seq))
        self._queued[identity] = entry
        heapq.heappush(self._heap, (*entry, identity))
        self._nonempty.set()

    def discard(self, identity: SpiffeId) -> None:
        self._queued.pop(identity, None)

    def pop_nowait(self) -> SpiffeId | None:
        while self._heap:
            priority, seq, identity = heapq.heappop(self._heap)
            if self._queued.get(identity) == (priority, seq):
                del self._queued[identity]
                return identity
        return None

    async def get(self) -> SpiffeId:
        while True:
            identity = self.pop_nowait()
            if identity is not None:
                return identity
            self._nonempty.clear()
            await self._nonempty.wait()


@dataclass
class IdentityState:
    """Everything the scheduler knows about one identity. Replaced (not reused) if the identity
    leaves and comes back, so stale timers and fetches can tell by identity of the object."""

    identity: SpiffeId
    name: str  # the SDS resource it is published as
    current: SignedCertificate | None = None
    generation: int = 0  # certificates installed so far
    restored: bool = False  # the current certificate came from a previous run's files
    started: bool = False  # the start hook has run
    failures: int = 0
    last_failure: FailureRecord | None = None
    next_rotation_at: datetime | None = None
    due_at: datetime | None = None  # when the pending timer fires (renewal or retry)
    authority: str | None = None  # the SKI hex of the current leaf's issuer
    taint_handled: int = -1  # the generation already rescheduled for a taint
    # The known taints (authority ID -> the generation whose re-sign it moved) this identity
    # was re-signed early for: never again while they stay known, whatever the CA answers
    # (`agent.taints`, rule 5).
    resigned_for: dict[str, int] = field(default_factory=dict)
    timer: asyncio.Task[None] | None = field(default=None, repr=False)

    def valid(self, now: datetime) -> bool:
        current = self.current
        return current is not None and current.leaf.not_valid_before_utc <= now < current.not_after

    def forget_taints(self, gone: set[str]) -> None:
        """These taints are no longer known; named again, each is a new taint (rule 5). An
        early re-sign still pending for the current leaf stays and serves the new one too;
        a leaf the CA answered it with may then be re-signed early once more."""
        if self.authority in gone and self.resigned_for.get(self.authority) != self.generation:
            self.taint_handled = -1
        for authority in gone & self.resigned_for.keys():
            del self.resigned_for[authority]

    def cancel_timer(self) -> None:
        if self.timer is not None and not self.timer.done():
            self.timer.cancel()
        self.timer = None
