"""What the agent knows of the CA's taints, merged from every source that tells it.

Two sources name the authorities the CA has tainted (`meshca authority taint`) and when:

- `report`: the answer to the periodic report (`agent.reporter`, every `--report-interval`,
  2 min by default), which says how long ago each was tainted;
- `taint-notice`: the taint notice beside the root file (`agent.taint_file`, `meshca-taints.json`
  in the directory of `--ca-root`), which the CA rewrites with the bundle and the agent sees
  within a poll of the file (a second) — in Kubernetes within the kubelet's refresh of the
  `istio-ca-root-cert` mount, as for a new root.

Both feed `KnownTaints.learn` and then the one scheduler (`CertificateScheduler.taints_learned`):
one path, so a taint from either counts the same. The rules:

1. What the CA confirmed stays: a taint the report's answer named stays known for the agent's
   life (bounded: the `MAX_KNOWN_TAINTS` most recent), whatever a later answer or notice
   says. A taint only the notice named is forgotten when a notice read later no longer names
   it: the notice is the whole list, and it is a file others may be able to write (whoever can
   edit `istio-ca-root-cert` in a namespace), so a bogus taint must not outlive the bogus
   notice. A notice that is missing or refused says nothing: it forgets nothing. A re-sign
   already scheduled is never cancelled: a genuine taint a lagging notice dropped is named
   again by the next notice or report, and a bogus one costs that one re-sign (rule 5).
2. The first source to name a taint sets its time; a later one does not move it (the
   pacing of each leaf is decided once, see `agent.rotation.RotationPolicy.taint_resign_delay`).
   It also stays the source the agent names in its log lines about that taint.
3. A taint time in the future by this agent's clock (the CA's or the operator's clock runs
   ahead) is counted from now, said once in a WARNING: the leaf is then re-signed within the
   window from now, never later, and never skipped.
4. An authority that signed none of the agent's leaves costs nothing: it is remembered (a
   restored or future leaf of it would be re-signed) and matches nothing today.
5. At most one early re-sign per leaf per taint (enforced by the scheduler): each identity is
   re-signed ahead of its normal rotation at most once for as long as a taint is known, even
   if the CA answers with a leaf of the same authority again (a CA process that has not
   caught up, or a bogus notice naming the authority that is in fact active); that leaf then
   rotates at its normal point. A taint forgotten and named again later is a new taint.

Pure apart from logging; time is handed in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

log = logging.getLogger(__name__)

SOURCE_REPORT = "report"
SOURCE_TAINT_NOTICE = "taint-notice"
MAX_KNOWN_TAINTS = 256
"""A CA holds a handful of authorities; the bound only keeps a misbehaving source finite."""


MAX_TAINT_AGE = timedelta(days=3650)
"""Older than any leaf or authority: a larger (or infinite, or not-a-number) age in a report
answer counts as this, so a broken or hostile answer cannot overflow the agent's datetimes."""


def taints_from_report(seconds_since: Mapping[str, float], now: datetime) -> dict[str, datetime]:
    """The report answer's taints (ID -> seconds since the taint, as the CA process sees it) as
    times on this agent's clock: free of any skew between the two clocks. An age below zero
    counts as now, one that is not a finite number below `MAX_TAINT_AGE` as that age."""
    limit = MAX_TAINT_AGE.total_seconds()
    return {
        ident: now
        - timedelta(seconds=since if 0.0 <= since <= limit else (0.0 if since < 0 else limit))
        for ident, since in seconds_since.items()
    }


@dataclass
class _Taint:
    at: datetime  # when, on this agent's clock
    source: str  # the first source that named it
    confirmed: bool  # the report's answer named it: never forgotten (rule 1)


@dataclass(frozen=True)
class Learnt:
    """What one `KnownTaints.learn` changed: the authorities named for the first time, and
    those no longer known (sorted)."""

    fresh: list[str]
    forgotten: list[str]


class KnownTaints:
    """Authority ID -> when it was tainted (this agent's clock), from every source (see the
    module docstring for the rules)."""

    def __init__(self) -> None:
        self._known: dict[str, _Taint] = {}

    def __contains__(self, ident: object) -> bool:
        return ident in self._known

    def __len__(self) -> int:
        return len(self._known)

    def get(self, ident: str | None) -> datetime | None:
        taint = self._known.get(ident) if ident else None
        return taint.at if taint else None

    def source(self, ident: str) -> str | None:
        """The source that first named the taint of `ident` (for log lines), if known."""
        taint = self._known.get(ident)
        return taint.source if taint else None

    def learn(self, tainted_at: Mapping[str, datetime], source: str, now: datetime) -> Learnt:
        """Adds what `source` says (for the notice, the whole list: it also forgets what only
        earlier notices named)."""
        fresh = []
        for ident, at in tainted_at.items():
            known = self._known.get(ident)
            if known is not None:
                known.confirmed = known.confirmed or source == SOURCE_REPORT
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
            self._known[ident] = _Taint(at, source, confirmed=source == SOURCE_REPORT)
            fresh.append(ident)
            log.info(
                "authority %s was tainted at %s (learnt from the %s)", ident, at.isoformat(), source
            )
        forgotten = []
        if source == SOURCE_TAINT_NOTICE:
            forgotten = [
                ident
                for ident, taint in self._known.items()
                if not taint.confirmed and ident not in tainted_at
            ]
            for ident in forgotten:
                del self._known[ident]
                log.info(
                    "forgetting the taint of authority %s: the taint notice no longer names it, "
                    "and the CA's report answer never did",
                    ident,
                )
        if len(self._known) > MAX_KNOWN_TAINTS:
            newest = sorted(self._known.items(), key=lambda item: item[1].at, reverse=True)
            forgotten += [ident for ident, _ in newest[MAX_KNOWN_TAINTS:]]
            self._known = dict(newest[:MAX_KNOWN_TAINTS])
        return Learnt(sorted(fresh), sorted(forgotten))
