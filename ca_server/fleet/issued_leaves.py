"""The latest leaf the CA issued per identity, bounded, to answer "which expire soonest?".

`meshca status` pointed at a CA lists the soonest-expiring leaves it knows of: an identity whose
latest leaf is close to expiry has stopped renewing (its agent lost the CA, or its pod is gone).
Only the latest leaf per identity is kept (a renewed identity's older leaves no longer matter),
in insertion order with the least recently renewed evicted beyond `capacity`, so memory stays
bounded however large the mesh is; the figure is per replica (each CA knows what it signed).

Thread-safety: written on the gRPC event loop, read from the monitoring server's thread; a lock
guards the dict.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

ISSUED_LEAVES_CAPACITY = 4096


@dataclass(frozen=True)
class IssuedLeaf:
    identity: str
    serial_hex: str
    issued_at: datetime
    not_after: datetime


class IssuedLeaves:
    """Latest leaf per identity, at most `capacity` identities."""

    def __init__(self, capacity: int = ISSUED_LEAVES_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._latest: OrderedDict[str, IssuedLeaf] = OrderedDict()
        self._recorded = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def recorded(self) -> int:
        """How many leaves were ever recorded: a publisher compares it with the figure it last
        wrote to skip rewriting an unchanged set."""
        with self._lock:
            return self._recorded

    def record(self, leaf: IssuedLeaf) -> None:
        with self._lock:
            self._latest.pop(leaf.identity, None)
            self._latest[leaf.identity] = leaf
            self._recorded += 1
            while len(self._latest) > self._capacity:
                self._latest.popitem(last=False)

    def soonest_expiring(self, now: datetime, limit: int) -> list[IssuedLeaf]:
        """Up to `limit` unexpired latest leaves, soonest NotAfter first; expired ones are
        dropped here (their identity has gone or is failing, which the agent side reports)."""
        with self._lock:
            for identity in [i for i, leaf in self._latest.items() if leaf.not_after <= now]:
                del self._latest[identity]
            leaves = list(self._latest.values())
        return heapq.nsmallest(limit, leaves, key=lambda leaf: leaf.not_after)

    def latest(self) -> list[IssuedLeaf]:
        """Every leaf held (the latest per identity), least recently renewed first."""
        with self._lock:
            return list(self._latest.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._latest)
