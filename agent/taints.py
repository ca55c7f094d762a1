"""What the agent knows of the CA's taints, merged from every source that tells it.

Two sources name the authorities the CA has tainted (`meshca authority taint`) and when:

- `report`: the answer to the periodic report (`agent.reporter`, every `--report-interval`,
  2 min by default), which says how long ago each was tainted;
- `taint-notice`: the taint notice beside the root file (`agent.taint_file`, `meshca-taints.json`
  in the directory of `--ca-root`), which the CA rewrites with the bundle and the agent sees
  within a poll of the file (a second) — in Kubernetes within the kubelet's refresh of the
  `istio-ca-root-cert` mount, as for a new root.

Both feed `KnownTaints.learn` and then the one scheduler (`CertificateScheduler.taints_learned`):
one path, so a taint from either counts the same and re-signs each leaf once. The rules:

1. Only ever added to: a taint, once learned, stays known for the agent's life (bounded:
   the `MAX_KNOWN_TAINTS` most recent). A source that no longer names an authority — a notice
   written by a CA process that lags one poll behind, or one revoked meanwhile — never
   un-taints it, and a re-sign already scheduled is never cancelled.
2. The first source to name a taint sets its time; a later one does not move it (the
   pacing of each leaf is decided once, see `agent.rotation.RotationPolicy.taint_resign_delay`).
3. A taint time in the future by this agent's clock (the CA's or the operator's clock runs
   ahead) is counted from now, said once in a WARNING: the leaf is then re-signed within the
   window from now, never later, and never skipped.
4. An authority that signed none of the agent's leaves costs nothing: it is remembered (a
   restored or future leaf of it would be re-signed) and matches nothing today.

Pure apart from logging; time is handed in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timedelta

log = logging.getLogger(__name__)

SOURCE_REPORT = "report"
SOURCE_TAINT_NOTICE = "taint-notice"
MAX_KNOWN_TAINTS = 256
"""A CA holds a handful of authorities; the bound only keeps a misbehaving source finite."""


def taints_from_report(seconds_since: Mapping[str, float], now: datetime) -> dict[str, datetime]:
    """The report answer's taints (ID -> seconds since the taint, as the CA process sees it) as
    times on this agent's clock: free of any skew between the two clocks."""
    return {
        ident: now - timedelta(seconds=max(0.0, since)) for ident, since in seconds_since.items()
    }


class KnownTaints:
    """Authority ID -> when it was tainted (this agent's clock), from every source (see the
    module docstring for the rules)."""

    def __init__(self) -> None:
        self._at: dict[str, datetime] = {}

    def __contains__(self, ident: object) -> bool:
        return ident in self._at

    def __len__(self) -> int:
        return len(self._at)

    def get(self, ident: str | None) -> datetime | None:
        return self._at.get(ident) if ident else None

    def learn(self, tainted_at: Mapping[str, datetime], source: str, now: datetime) -> list[str]:
        """Adds what `source` says; returns the authorities it named first (sorted)."""
        fresh = []
        for ident, at in tainted_at.items():
            if ident in self._at:
                continue
            if at > now:
                log.warning(
                    "the %s says authority %s was tainted at %s, %.0f s ahead of this agent's "
                    "clock; counting the taint from now (check the clocks of the CA, the host "
                    "that ran `meshca authority taint` and this agent)",
                    source,
                    ident,
                    at.isoformat(),
                    (at - now).total_seconds(),
                )
                at = now
            self._at[ident] = at
            fresh.append(ident)
            log.info(
                "authority %s was tainted at %s (learnt from the %s)", ident, at.isoformat(), source
            )
        if len(self._at) > MAX_KNOWN_TAINTS:
            newest = sorted(self._at.items(), key=lambda item: item[1], reverse=True)
            self._at = dict(newest[:MAX_KNOWN_TAINTS])
        return sorted(fresh)
