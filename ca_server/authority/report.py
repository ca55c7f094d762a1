"""The authority slots as operators see them: one row per slot with its live leaves and coverage.

One builder for every view of the slots, so they cannot drift apart: `meshca authority show`
and `meshca status --data-dir/--kubeconfig` build the rows from the shared state they read, and
a running CA builds the same rows for its `/debug/ca` (read by `meshca status ADDRESS`) from the
state it converged on.

The figures beside the state come from every CA process's published reports
(`ca_server.fleet.LedgerSink`): live leaves per authority and the agents' reports.
`None` for a figure that could not be read is printed as "unknown", never as zero: an API or file
failure must not look like an empty fleet.

In a running CA, `AuthorityReport` holds the last section its driver built (each self-signed
round: the converged state plus the figures read then), so a request to `/debug/ca` reads memory
only and never waits on files or the API server. The driver writes from a worker thread; readers
(the monitoring thread, a worker's status publisher) take the current snapshot, which is
replaced whole, never changed in place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ca_server.authority.agent_stragglers import STATUS_LIMIT, agents_section
from ca_server.authority.slots import AuthorityState, Slot, gate_waiting
from ca_server.fleet import Coverage, FleetReports, authority_coverage

UNKNOWN = "unknown"


def slot_rows(
    state: AuthorityState, live: dict[str, int] | None, agents: Coverage | None = None
) -> list[dict[str, Any]]:
    """One row per slot (active, prepared, then old ones), the same fields for table and JSON."""
    return [_row(slot, live, agents) for slot in state.ranked()]


def _row(slot: Slot, live: dict[str, int] | None, agents: Coverage | None) -> dict[str, Any]:
    return {
        "id": slot.id,
        "state": slot.phase.value,
        "tainted": slot.tainted,
        "not_before": slot.not_before.isoformat(),
        "not_after": slot.not_after.isoformat(),
        "issuer": slot.cert.issuer.rfc4514_string(),
        "live_leaves": live.get(slot.id, 0) if live is not None else UNKNOWN,
        # Agents whose bundle holds this authority, out of every agent that reported.
        "agents_trusting": agents.trusting.get(slot.id, 0) if agents is not None else UNKNOWN,
        "agents_reporting": agents.reporting if agents is not None else UNKNOWN,
        # Reporting agents that still serve a leaf it signed: revoking it breaks those.
        "agents_serving": agents.serving.get(slot.id, 0) if agents is not None else UNKNOWN,
        # Reports the CA processes could not publish or read: not trusting, maybe serving.
        "agents_unseen": _unseen(agents),
    }


def _unseen(agents: Coverage | None) -> int | str:
    """Reports nobody could see; "unknown" when a snapshot could not be read at all (how many
    agents it held, nobody knows)."""
    if agents is None or agents.unreadable:
        return UNKNOWN
    return agents.unseen


def fleet_coverage(state: AuthorityState, fleet: FleetReports | None) -> Coverage | None:
    """Which of the state's authorities the reporting agents trust (`ca_server.fleet.coverage`)."""
    if fleet is None:
        return None
    return authority_coverage([(slot.id, slot.cert) for slot in state.slots], fleet)


def show_document(
    state: AuthorityState, live: dict[str, int] | None, agents: Coverage | None
) -> dict[str, Any]:
    """What `meshca authority show -o json` prints: the rows, the count of callers that send
    no report (Istio's agents), and the activation gate if it is holding an activation."""
    return {
        "authorities": slot_rows(state, live, agents),
        "agents_unknown": agents.unknown if agents is not None else UNKNOWN,
        "activation_gate": activation_gate(state, agents),
    }


def activation_gate(state: AuthorityState, agents: Coverage | None) -> dict[str, Any] | None:
    """The prepared authority's activation held by a CA's coverage gate (`--activate-at-
    coverage`: the CA writes an `activation-gated` event when it starts waiting), with the
    coverage now; `None` when no activation waits."""
    event = gate_waiting(state)
    if event is None:
        return None
    return {
        "authority": event.authority,
        "waiting_since": event.at.isoformat(),
        "reason": event.reason,
        "agents_trusting": agents.trusting.get(event.authority, 0) if agents else UNKNOWN,
        "agents_reporting": agents.reporting if agents is not None else UNKNOWN,
        "agents_unseen": _unseen(agents),
    }


def coverage_summary(state: AuthorityState, agents: Coverage | None) -> dict[str, Any]:
    """How far each authority has spread over the agents that report, as a fraction, and how
    much the count leaves out (callers without a report; reports a process could not publish
    or a reader could not read, counted as not trusting, so every fraction is a lower bound)."""
    if agents is None:
        return {
            "agents_reporting": UNKNOWN,
            "agents_unknown": UNKNOWN,
            "reports_left_out": UNKNOWN,
            "reports_unreadable": UNKNOWN,
            "authorities": [],
        }
    return {
        "agents_reporting": agents.reporting,
        "agents_unknown": agents.unknown,
        "reports_left_out": agents.dropped,
        "reports_unreadable": agents.unreadable,
        "authorities": [
            {
                "id": slot.id,
                "state": slot.phase.value,
                "agents_trusting": agents.trusting.get(slot.id, 0),
                "fraction": (
                    agents.trusting.get(slot.id, 0) / (agents.reporting + agents.unseen)
                    if agents.reporting + agents.unseen
                    else None
                ),
            }
            for slot in state.ranked()
        ],
    }


def status_section(
    state: AuthorityState, live: dict[str, int] | None, fleet: FleetReports | None
) -> dict[str, Any]:
    """The slots for `meshca status`: `show_document`'s fields plus `coverage_summary` and the
    pods a prepared or tainted authority waits on (`ca_server.authority.agent_stragglers`)."""
    agents = fleet_coverage(state, fleet)
    return {
        **show_document(state, live, agents),
        "coverage": coverage_summary(state, agents),
        "agents": agents_section(state, fleet, limit=STATUS_LIMIT),
    }


@dataclass(frozen=True)
class ReportSnapshot:
    section: dict[str, Any]
    changed_at: datetime  # when the section last differed from the one before
    version: int  # bumped at each change, so a publisher knows when to write again


class AuthorityReport:
    """A running CA's latest `status_section` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one writer at a time; readers take `snapshot` unlocked
        self.snapshot: ReportSnapshot | None = None

    def update(
        self,
        state: AuthorityState,
        live: dict[str, int] | None,
        fleet: FleetReports | None,
        now: datetime,
    ) -> None:
        section = status_section(state, live, fleet)
        with self._lock:
            current = self.snapshot
            if current is not None and current.section == section:
                return
            version = current.version + 1 if current is not None else 1
            self.snapshot = ReportSnapshot(section, now, version)


def report_section(report: AuthorityReport | None) -> dict[str, Any] | None:
    """The section to show: `None` without slots (a plugged-in CA) or before the first round."""
    snapshot = report.snapshot if report is not None else None
    return snapshot.section if snapshot is not None else None
