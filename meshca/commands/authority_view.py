"""The authority slots read from the shared state and printed, for `meshca authority` and
`meshca status --data-dir/--kubeconfig`: one place that opens the state (the data directory, or
the cluster's Secret and replica ConfigMaps), reads the CA processes' published figures, and
draws the table, so both commands print the slots alike (and `meshca status ADDRESS` draws a
running CA's `/debug/ca` section, which has the same fields, with the same table).

Reading is the commands' business: a figure that cannot be read is reported on stderr and shown
as "unknown" (`ca_server.authority.report`), never as zero.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from ca_server.authority import (
    AuthorityCommandError,
    SharedState,
    SlotFactory,
    open_shared_state,
)
from ca_server.config import DEFAULT_NAMESPACE
from ca_server.fleet import FleetReports, LedgerSink
from meshca.clock import SystemClock

AUTHORITY_COLUMNS = (
    ("id", "ID"),
    ("state", "STATE"),
    ("tainted", "TAINTED"),
    ("not_before", "NOT BEFORE"),
    ("not_after", "NOT AFTER"),
    ("live_leaves", "LIVE LEAVES"),
    ("agents", "AGENTS"),
    ("agents_serving", "SERVING"),
    ("issuer", "ISSUER"),
)


def add_target_arguments(
    parser: argparse.ArgumentParser, where: argparse._MutuallyExclusiveGroup
) -> None:
    """`--data-dir` or `--kubeconfig` (in `where`, one of them) and `--namespace`."""
    where.add_argument("--data-dir", type=Path, help="the CA's data directory (local mode)")
    where.add_argument(
        "--kubeconfig", type=Path, help="Kubernetes mode: the cluster whose Secret holds them"
    )
    parser.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="the CA's namespace (Kubernetes mode)"
    )


Target = SharedState  # the slots' store and every CA process's published figures


class Retirable(Protocol):
    """What the last two verbs change: the X.509 slots or the JWT-SVID keys."""

    def taint(self, ident: str, now: datetime, /) -> Self: ...

    def revoke(self, ident: str, now: datetime, /) -> Self: ...


Retiring = TypeVar("Retiring", bound=Retirable)


def taint_or_revoke(
    state: Retiring, verb: str, ident: str | None, now: datetime, needs: str
) -> Retiring:
    """`meshca authority taint|revoke ID` (with or without `--jwt`): the same rules on both,
    each state's own refusals; without an ID, refused saying it `needs` one."""
    if ident is None:
        raise AuthorityCommandError(needs)
    return state.taint(ident, now) if verb == "taint" else state.revoke(ident, now)


@contextlib.contextmanager
def open_target(args: argparse.Namespace, factory: SlotFactory, agent: str) -> Iterator[Target]:
    """The shared state named by `args.data_dir`, or `args.kubeconfig` + `args.namespace`;
    `agent` names the command to the API server."""
    clock = SystemClock()  # the commands are roots: the one place the system clock is chosen
    with open_shared_state(
        args.data_dir, args.kubeconfig, args.namespace, factory, clock, agent
    ) as target:
        yield target


def no_authorities_message(target: Target) -> str:
    return (
        f"there are no self-signed authorities yet ({target.store.description}); start "
        "`meshca ca` with the same --data-dir (or cluster) first. A CA with --cacerts-dir is "
        "rotated through that directory instead (docs/rotate-the-ca.md)"
    )


def read_live_leaves(ledgers: LedgerSink, name: str) -> dict[str, int] | None:
    """Every CA process's live leaves, or `None` (printed "unknown") if they cannot be read."""
    try:
        return ledgers.live(datetime.now(UTC))
    except Exception as exc:  # an API or file failure must not hide the authorities themselves
        print(f"{name}: cannot read the CA processes' leaf ledgers: {exc}", file=sys.stderr)
        return None


def read_fleet(ledgers: LedgerSink, name: str) -> FleetReports | None:
    """Every CA process's agent reports merged (`ca_server.fleet.merge`), or `None`
    (printed "unknown") if they cannot be read; warns when some did not fit (coverage a lower
    bound)."""
    try:
        fleet = ledgers.agents(datetime.now(UTC))
    except Exception as exc:  # an API or file failure must not hide the authorities themselves
        print(f"{name}: cannot read the CA processes' agent reports: {exc}", file=sys.stderr)
        return None
    if fleet.dropped:
        print(
            f"{name}: {fleet.dropped} agent reports did not fit in the CA processes' published "
            "reports (size limit) and are not counted: coverage is a lower bound",
            file=sys.stderr,
        )
    if fleet.unreadable:
        print(
            f"{name}: {fleet.unreadable} CA process report(s) cannot be read: their agents count "
            "as not trusting and maybe serving",
            file=sys.stderr,
        )
    return fleet


def render_authorities(section: dict[str, Any]) -> str:
    """The slots table of `meshca authority show` from its JSON fields (`authorities`,
    `agents_unknown`, `activation_gate`), with the line that explains the AGENTS column and,
    while a gated activation waits, one that says so."""
    table = [[title for _key, title in AUTHORITY_COLUMNS]]
    table += [
        [_cell(row, key) for key, _title in AUTHORITY_COLUMNS] for row in section["authorities"]
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(AUTHORITY_COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]
    lines.append(
        "AGENTS = agents trusting it / agents reporting; SERVING = reporting agents still "
        "serving a leaf it signed; callers sending no report (e.g. Istio's agents, counted as "
        f"unknown): {section['agents_unknown']}"
    )
    gate = section.get("activation_gate")
    if gate:
        lines.append(
            f"activation of {gate['authority']} is WAITING (--activate-at-coverage): "
            f"{gate['agents_trusting']}/{gate['agents_reporting']} reporting agents trust it; "
            f"{gate['reason']}"
        )
    return "\n".join(lines)


def _cell(row: dict[str, Any], column: str) -> str:
    if column == "tainted":
        return "yes" if row["tainted"] else "no"
    if column == "agents":
        return f"{row['agents_trusting']}/{row['agents_reporting']}"
    return str(row.get(column, "unknown"))  # e.g. a field an older CA does not send


def render_coverage(coverage: dict[str, Any]) -> str:
    """One line per authority: the share of reporting agents whose bundle holds it."""
    reporting = coverage["agents_reporting"]
    head = (
        f"coverage: {reporting} agents reporting, {coverage['agents_unknown']} callers without "
        "a report (not counted)"
    )
    left_out = coverage["reports_left_out"]
    if isinstance(left_out, int) and left_out:
        head += f"; {left_out} reports did not fit in the published reports: a lower bound"
    lines = [head]
    for entry in coverage["authorities"]:
        fraction = entry["fraction"]
        share = f"{fraction:.0%}" if fraction is not None else "-"
        lines.append(
            f"  {entry['state']:<8} {entry['id']}  trusted by {entry['agents_trusting']}/"
            f"{reporting} ({share})"
        )
    return "\n".join(lines)
