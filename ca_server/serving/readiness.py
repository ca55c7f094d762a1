"""Whether the CA can sign anything a workload would accept: what `/ready` answers beyond
"serving", and the one ERROR line an operator sees when it cannot.

A CA whose signing chain has expired (say `--no-root-rotation` and nobody rotated) or is not
valid yet (a clock behind the one that made it) still accepts connections, but every leaf it
signs fails verification, and its own serving certificate with it. Readiness says so — `/ready`
answers 503 with the reason, so a load balancer or kubelet stops sending it traffic — and the
CA logs it once when it happens (and once when it is over), whether or not anyone polls `/ready`.
A worker of `meshca ca --workers N` has no `/ready` of its own: it writes the reason into its
ready file, which its supervisor's `/ready` reads (`ca_server.serving.workers`).

Concurrency: `problem` is called from the monitoring server's thread and from `watch` on the
event loop; it only reads the signer's current authority (one reference) and the clock, and
serialises its log transitions with a lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from ca_server.authority import chain_problem
from certs import SigningAuthority
from meshca.clock import Clock

log = logging.getLogger(__name__)


class SigningReadiness:
    def __init__(
        self,
        authority: Callable[[], SigningAuthority],
        clock: Clock,
        on_change: Callable[[str | None], None] = lambda problem: None,
    ) -> None:
        self._authority = authority
        self._clock = clock
        self.on_change = on_change  # a worker tells its supervisor (`ca_server.serving.workers`)
        self._lock = threading.Lock()
        self._reported: str | None = None

    def problem(self) -> str | None:
        """Why the current signing chain is unusable now, else `None`; logs each change."""
        found = chain_problem(self._authority(), self._clock.now())
        with self._lock:
            if found != self._reported:
                if found is not None:
                    log.error("not ready: %s", found)
                else:
                    log.info("ready again: the signing chain is valid")
                self._reported = found
                try:
                    self.on_change(found)
                except OSError as exc:  # e.g. a full disk: /ready itself still answers right
                    log.warning("could not record the readiness change: %s", exc)
        return found

    async def watch(self, interval: timedelta) -> None:
        """Checks every `interval` until cancelled, so the ERROR line comes without a probe."""
        while True:
            self.problem()
            await self._clock.sleep(interval.total_seconds())
