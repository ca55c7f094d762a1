"""Follows the CA's taint notice beside the root file, so a taint reaches the agent as fast as a
new trust bundle does.

The CA writes `meshca-taints.json` (`meshca.taint_notice`) beside `root-cert.pem`, in the same
step: in local mode both files in `--data-dir`, in Kubernetes mode both keys of the
`istio-ca-root-cert` ConfigMap, which the kubelet mounts as one directory. The agent reads the
file named so in the directory of its `--ca-root` (`CA_ROOT_CA`), polled like the root file
(`agent.polled_file`: a `stat` a second, the kubelet's `..data` swap seen as a change), and
hands each new version's taints to the scheduler (`CertificateScheduler.taints_learned`), the
path the periodic report's answer also takes (`agent.taints`).

What the file can and cannot do, since whoever writes it steers the agent:

- only the CA writes it, where only the CA writes `root-cert.pem` (its data directory; the
  ConfigMap only it updates), and whoever can write there can already replace the bundle,
  which is worse: the notice gives no new power;
- it can add taints, and take back only what notices alone named (`agent.taints`, rule 1: a
  taint the CA's report answer confirmed stays; a deleted or refused notice takes back
  nothing); it never cancels a scheduled re-sign, never changes what the agent trusts, and
  never makes it serve anything. The most a taint it names causes is one early re-sign per
  leaf (identity) of the named authority, paced over `--taint-resign-window` like any taint,
  even when the CA answers with a leaf of the same authority again (rule 5); an authority that
  signed none of the agent's leaves causes nothing. A notice naming the active authority for
  a moment costs each identity that one re-sign, not one per report;
- a taint time in the future is counted from now (`agent.taints`, rule 3);
- it is read strictly: larger than `meshca.taint_notice.MAX_NOTICE_BYTES` (refused before it is
  read), not a regular file, or not exactly a version-1 notice (whatever the content: the
  decoder raises nothing but `TaintNoticeError`): ignored whole, with one WARNING per version
  of the file and `meshca_agent_taint_notice_refused_total`; what was learnt stays. At start
  too: the agent then starts without the notice's taints and gets its certificates. A
  callback that fails for any other reason (a bug) is one ERROR, and the file is still
  followed (`agent.polled_file`). A missing file is normal (Istio's CA, an older meshca, a
  `--ca-root` that is not the CA's published one): said once at INFO, and taints then come
  from the report alone.

Concurrency: on the agent's event loop; the file's `stat`s and reads run in a worker thread
(`agent.polled_file`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path

from agent.metrics import AgentMetrics
from agent.polled_file import DEFAULT_POLL_INTERVAL, PolledFile
from agent.taints import SOURCE_TAINT_NOTICE
from meshca.clock import Clock
from meshca.taint_notice import (
    MAX_NOTICE_BYTES,
    TAINT_NOTICE_NAME,
    TaintNoticeError,
    decode_taint_notice,
)

log = logging.getLogger(__name__)

OnTaints = Callable[[Mapping[str, datetime], str], int]
"""`CertificateScheduler.taints_learned`: (ID -> taint time, source) -> leaves rescheduled."""


def taint_notice_beside(root_file: Path) -> Path:
    """Where the CA publishes its taint notice for agents that read `root_file`."""
    return root_file.parent / TAINT_NOTICE_NAME


class TaintFileWatch:
    """Follows one taint notice file (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        on_taints: OnTaints,
        clock: Clock,
        metrics: AgentMetrics,
        *,
        interval: float = DEFAULT_POLL_INTERVAL,
    ) -> None:
        self.path = path
        self._on_taints = on_taints
        self._refused = metrics.taint_notice_refused
        self._file = PolledFile(
            path,
            clock,
            on_change=self._changed,
            on_error=self._unreadable,
            interval=interval,
            max_bytes=MAX_NOTICE_BYTES,
        )
        self.accepted = 0
        self.refused = 0

    async def start(self) -> None:
        """Reads the notice once before returning (so its taints are known before any
        certificate is restored or fetched), then follows it."""
        await self._file.start()

    async def stop(self) -> None:
        await self._file.stop()

    async def _changed(self, data: bytes) -> None:
        try:
            tainted = decode_taint_notice(data)
        except TaintNoticeError as exc:
            self._refuse(str(exc))
            return
        self.accepted += 1
        log.debug("taint notice %s names %d tainted authorities", self.path, len(tainted))
        self._on_taints(tainted, SOURCE_TAINT_NOTICE)

    def _unreadable(self, reason: str) -> None:
        if not os.path.lexists(self.path):
            log.info(
                "no taint notice at %s (the CA publishes none there); taints are learnt from "
                "the periodic report alone until it appears",
                self.path,
            )
            return
        self._refuse(reason)

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        self._refused.inc()
        log.warning(
            "ignoring the taint notice %s: %s; the taints already known stay, and the periodic "
            "report still delivers new ones",
            self.path,
            reason,
        )
