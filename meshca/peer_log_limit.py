"""At most one log line per peer per interval, for what unauthenticated peers can repeat at will.

A daemon that logs every malformed request lets any client that reaches its port write to its
log as fast as it can send. `PeerLogLimit` keeps the first line about a peer and holds back the
rest for `interval` seconds; the next line it lets through, about whichever peer, says how many
it held back since the last one, so nothing goes unnoticed. A peer is its address without the port
(`ipv4:10.0.0.7`), so a client cannot earn a new line by opening a new connection.

Bounded: it remembers at most `max_peers` peers, each for `interval`. When a flood comes from
more peers than that, the peers beyond it are held back too (and counted) until the oldest entry
ages out, so the table never grows past `max_peers` and the log gets at most `max_peers` lines
per interval, however many addresses send.

Time is injected (`monotonic`). Thread-safe: the CA's handlers run on the completion-queue
thread and on the event loop (`ca_server.serving.cq_server`), so each call takes a lock for a
few dictionary operations.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_PEER_CHARS = 120  # a peer string comes from grpc core; a unix socket path can be long


def peer_host(peer: str) -> str:
    """`ipv4:10.0.0.7:41234` → `ipv4:10.0.0.7` (likewise `ipv6:[::1]:41234`); other forms as
    they are (a unix socket's peer has no port), clipped to `MAX_PEER_CHARS`."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, colon, port = rest.rpartition(":")
        if colon and port.isdigit():
            peer = f"{kind}:{host}"
    return peer[:MAX_PEER_CHARS]


class PeerLogLimit:
    """`log(peer, message, *args)`: logs unless `peer` got a line in the last `interval`
    seconds, or `max_peers` other peers did (module docstring)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        level: int = logging.INFO,
        interval: float = 60.0,
        max_peers: int = 256,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0 or max_peers < 1:
            raise ValueError("PeerLogLimit needs interval > 0 and max_peers >= 1")
        self._logger = logger
        self._level = level
        self._interval = interval
        self._max_peers = max_peers
        self._monotonic = monotonic
        # peer → when its last line was logged; in that order (entries are only ever appended)
        self._logged_at: OrderedDict[str, float] = OrderedDict()
        self._held_back = 0
        self._lock = threading.Lock()

    def log(self, peer: str, message: str, *args: object) -> bool:
        """Logs `message % args` (with how many lines were held back since the last one) if
        `peer` may have a line now; returns whether it logged."""
        key = peer_host(peer)
        with self._lock:
            now = self._monotonic()
            self._forget_before(now - self._interval)
            if key in self._logged_at or len(self._logged_at) >= self._max_peers:
                self._held_back += 1
                return False
            self._logged_at[key] = now
            held_back, self._held_back = self._held_back, 0
        if held_back:
            message += (
                f" ({held_back} more such lines held back since the last one logged, from any "
                f"peer: at most one per peer per {self._interval:g}s)"
            )
        self._logger.log(self._level, message, *args)
        return True

    def peers(self) -> int:
        """How many peers it remembers now (at most `max_peers`)."""
        with self._lock:
            return len(self._logged_at)

    def _forget_before(self, cutoff: float) -> None:
        while self._logged_at:
            peer, logged_at = next(iter(self._logged_at.items()))
            if logged_at > cutoff:
                return
            del self._logged_at[peer]
