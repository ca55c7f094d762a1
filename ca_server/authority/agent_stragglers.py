"""Who, not just how many: the pods behind a coverage figure an operator is waiting on.

A gated activation waits for the pods that do not trust the prepared authority yet; a revoke
waits for the pods that still serve a leaf of the tainted one. `agents_section` names them —
pod (namespace/name, from the credential, never from what the agent said), identity, node,
last report, and the agent id it chose as a label — so an operator can go and look at exactly
those, and tell one workload's forged reports from a real fleet's (`top_callers`: the
per-identity attribution counter, an outlier stands out). The counts are exact; the lists are
cut at `limit` pods each (sorted by namespace/name) with how many were left out, so the section
stays small for 100,000 agents. What the CA could not see (`unseen`, `unreadable`) is said
beside them: those pods could be on either list.

One builder for `meshca authority show ID --agents` (text and `-o json`) and `meshca status`
(the `agents` field of a CA's slots section).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from ca_server.authority.slots import AuthorityState, Phase, Slot
from ca_server.fleet import FleetEntry, FleetReports, subset_digests

DEFAULT_LIMIT = 1000  # pods listed per list (the counts are always exact)
STATUS_LIMIT = 50  # in `meshca status`, which shows every prepared and tainted authority
TOP_CALLERS = 10


def _row(entry: FleetEntry) -> dict[str, Any]:
    return {
        "pod": entry.pod,
        "identity": entry.identity,
        "node": entry.node,
        "last_report": datetime.fromtimestamp(entry.refreshed, UTC).isoformat(),
        "agent_id": entry.label,
    }


def _listed(entries: Iterable[FleetEntry], limit: int) -> dict[str, Any]:
    ordered = sorted(entries, key=lambda e: (e.pod, e.key))
    return {
        "count": len(ordered),
        "pods": [_row(e) for e in ordered[:limit]],
        "not_listed": max(0, len(ordered) - limit),
    }


def slot_stragglers(
    state: AuthorityState, fleet: FleetReports, slot: Slot, limit: int = DEFAULT_LIMIT
) -> dict[str, Any]:
    """For one authority: the reporting pods whose bundle does not hold it, and those that
    still serve a leaf it signed."""
    by_digest = subset_digests([(s.id, s.cert) for s in state.slots])
    entries = fleet.entries.values()
    return {
        "id": slot.id,
        "state": slot.phase.value,
        "tainted": slot.tainted,
        "not_trusting": _listed(
            (e for e in entries if slot.id not in by_digest.get(e.bundle or "", frozenset())),
            limit,
        ),
        "serving": _listed((e for e in entries if slot.id in e.leaves), limit),
    }


def agents_section(
    state: AuthorityState,
    fleet: FleetReports | None,
    ident: str | None = None,
    limit: int = DEFAULT_LIMIT,
) -> dict[str, Any] | None:
    """The stragglers of authority `ident`, or (without one) of every prepared or tainted
    authority — the ones somebody waits on; `None` when the reports could not be read."""
    if fleet is None:
        return None
    slots = (
        [state.find(ident)]
        if ident is not None
        else [s for s in state.ranked() if s.phase is Phase.PREPARED or s.tainted]
    )
    top = sorted(fleet.callers.items(), key=lambda item: (-item[1][0], item[0]))[:TOP_CALLERS]
    return {
        "authorities": [slot_stragglers(state, fleet, slot, limit) for slot in slots],
        "reporting": len(fleet.entries),
        "unseen": fleet.dropped,
        "unreadable": fleet.unreadable,
        "unknown_identities": sorted(fleet.unknown)[:limit],
        "top_callers": [
            {"identity": identity, "reports": reports, "relabels": relabels}
            for identity, (reports, relabels) in top
        ],
    }


def render_agents(section: dict[str, Any] | None) -> str:
    """The text form of `agents_section` (under `meshca authority show ID --agents`)."""
    if section is None:
        return "agents: unknown (the CA processes' agent reports cannot be read)"
    lines: list[str] = []
    for slot in section["authorities"]:
        for key, what in (("not_trusting", "do not trust"), ("serving", "still serve a leaf of")):
            listed = slot[key]
            if key == "serving" and not slot["tainted"] and not listed["count"]:
                continue
            lines.append(f"{listed['count']} pod(s) {what} {slot['id']} ({slot['state']}):")
            lines.extend(
                f"  {row['pod']}  {row['identity']}  node={row['node'] or '-'}  "
                f"last-report={row['last_report']}  agent-id={row['agent_id'] or '-'}"
                for row in listed["pods"]
            )
            if listed["not_listed"]:
                lines.append(
                    f"  ... and {listed['not_listed']} more (-o json lists up to the limit)"
                )
    blind = section["unseen"]
    lines.append(
        f"{section['reporting']} pods reporting; {blind} report(s) unseen and "
        f"{section['unreadable']} replica report(s) unreadable (could be on either list)"
    )
    if section["top_callers"]:
        lines.append("reports by caller (identity: reports, label changes):")
        lines.extend(
            f"  {c['identity']}: {c['reports']}, {c['relabels']}" for c in section["top_callers"]
        )
    return "\n".join(lines)
