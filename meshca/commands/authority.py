"""`meshca authority show|prepare|activate|taint|revoke [ID] [-o json]` — the operator's hands on
the CA's authority slots, through the same shared state the CA processes watch.

Every change is one store transaction (the data directory's lock, or the Secret's
resourceVersion), audited on stderr, and reaches every running CA process within its poll
interval. Refusals (`AuthorityCommandError`) say why and what to do; nothing is written then.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ca_server.agent_reports import Coverage, coverage
from ca_server.authority_slots import AuthorityCommandError, AuthorityState, Phase, Slot
from ca_server.authority_state import (
    LEGACY_CERT,
    STATE_FILE,
    AuthorityStateStore,
    LocalAuthorityStateStore,
    SlotFactory,
)
from ca_server.config import DEFAULT_NAMESPACE
from ca_server.leaf_ledger import DirectoryLedgerSink, LedgerSink
from ca_server.root_store import CaSetupError
from ca_server.rotation import audit_events
from certs import DEFAULT_TRUST_DOMAIN, CertsError, KeySpec
from meshca.clock import SystemClock
from meshca.durations import parse_duration
from meshca.logs import configure_logging

UNKNOWN = "unknown"
_VERBS = ("show", "prepare", "activate", "taint", "revoke")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("verb", choices=_VERBS)
    parser.add_argument(
        "id", nargs="?", default=None, help="authority ID (Subject Key ID hex, or a prefix)"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--data-dir", type=Path, help="the CA's data directory (local mode)")
    where.add_argument(
        "--kubeconfig", type=Path, help="Kubernetes mode: the cluster whose Secret holds them"
    )
    parser.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="the CA's namespace (Kubernetes mode)"
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument(
        "--root-key",
        default="ec-p256",
        help="prepare: key type of the new authority (ec-p256, ec-p384, rsa-2048...)",
    )
    parser.add_argument(
        "--root-ttl",
        default=None,
        help="prepare: lifetime of the new authority (default: the active one's)",
    )
    parser.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN)


@dataclass(frozen=True)
class _Target:
    store: AuthorityStateStore
    ledgers: LedgerSink  # where every CA process publishes its live leaves
    exists: bool


@contextlib.contextmanager
def _target(args: argparse.Namespace, factory: SlotFactory) -> Iterator[_Target]:
    clock = SystemClock()  # the command is a root: the one place the system clock is chosen
    if args.data_dir is not None:
        data_dir: Path = args.data_dir
        exists = (data_dir / STATE_FILE).exists() or (data_dir / LEGACY_CERT).exists()
        store = LocalAuthorityStateStore(data_dir, factory, clock)
        yield _Target(store, DirectoryLedgerSink(data_dir, "meshca-authority"), exists)
        return
    from ca_server.kube.clients import build_api_client
    from ca_server.kube.replica_reports import ConfigMapLedgerSink
    from ca_server.kube.secret_root import KubeAuthorityStateStore

    api = build_api_client(args.kubeconfig, pool_size=2, user_agent="meshca-authority")
    try:
        kube_store = KubeAuthorityStateStore(api, args.namespace, factory, clock)
        ledgers = ConfigMapLedgerSink(api, args.namespace, "meshca-authority")
        yield _Target(kube_store, ledgers, kube_store.exists())
    finally:
        api.close()


def run(args: argparse.Namespace) -> int:
    configure_logging("WARNING", audit_stream=sys.stderr)
    name = f"meshca authority {args.verb}"
    try:
        spec = KeySpec.parse(args.root_key)
        lifetime = parse_duration(args.root_ttl) if args.root_ttl else None
    except (CertsError, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    try:
        # Without --root-ttl, `prepare` gives the new authority the active one's lifetime; the
        # store's factory only makes a first authority, which this command never does.
        factory = SlotFactory(spec, args.trust_domain, lifetime or timedelta(days=3650))
        with _target(args, factory) as target:
            if not target.exists:
                print(
                    f"{name}: there are no self-signed authorities yet "
                    f"({target.store.description}); start `meshca ca` with the same "
                    "--data-dir (or cluster) first. A CA with --cacerts-dir is rotated through "
                    "that directory instead (docs/rotate-the-ca.md)",
                    file=sys.stderr,
                )
                return 2
            if args.verb == "show":
                state = target.store.read()
            else:
                state = _change(args, target.store, factory, lifetime, name)
            live = _live_leaves(target.ledgers, name)
            agents = _coverage(target.ledgers, state, name)
    except AuthorityCommandError as exc:
        print(f"{name}: refused: {exc}", file=sys.stderr)
        return 3
    except CaSetupError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    _print(state, live, agents, args.output)
    return 0


def _live_leaves(ledgers: LedgerSink, name: str) -> dict[str, int] | None:
    """Every CA process's live leaves, or `None` (printed "unknown") if they cannot be read."""
    try:
        return ledgers.live(datetime.now(UTC))
    except Exception as exc:  # an API or file failure must not hide the authorities themselves
        print(f"{name}: cannot read the CA processes' leaf ledgers: {exc}", file=sys.stderr)
        return None


def _coverage(ledgers: LedgerSink, state: AuthorityState, name: str) -> Coverage | None:
    """Which authorities the reporting agents trust (`ca_server.agent_reports`), or `None`
    (printed "unknown") if the CA processes' reports cannot be read."""
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
    return coverage([(slot.id, slot.cert) for slot in state.slots], fleet)


def _change(
    args: argparse.Namespace,
    store: AuthorityStateStore,
    factory: SlotFactory,
    lifetime: timedelta | None,
    name: str,
) -> AuthorityState:
    now = datetime.now(UTC)
    before: list[AuthorityState] = []

    def change(state: AuthorityState) -> AuthorityState:
        before[:] = [state]
        if args.verb == "prepare":
            life = lifetime or state.active.lifetime
            maker = SlotFactory(factory.key_spec, factory.trust_domain, life)
            return state.prepare(lambda: maker.new(now, Phase.PREPARED), now, "operator")
        if args.verb == "activate":
            return state.activate(args.id, now, "operator")
        if args.id is None:
            raise AuthorityCommandError(f"`{name}` needs the authority ID (see `show`)")
        if args.verb == "taint":
            return state.taint(args.id, now)
        return state.revoke(args.id, now)

    state = store.transact(change)
    seen = set(before[0].history) if before else set()
    audit_events(tuple(e for e in state.history if e not in seen), "meshca authority")
    return state


def slot_rows(
    state: AuthorityState, live: dict[str, int] | None, agents: Coverage | None = None
) -> list[dict[str, Any]]:
    """One row per slot, the same fields for the table and JSON."""
    return [_row(slot, live, agents) for slot in state.ranked()]


def _row(slot: Slot, live: dict[str, int] | None, agents: Coverage | None) -> dict[str, Any]:
    issuer = slot.cert.issuer.rfc4514_string()
    return {
        "id": slot.id,
        "state": slot.phase.value,
        "tainted": slot.tainted,
        "not_before": slot.not_before.isoformat(),
        "not_after": slot.not_after.isoformat(),
        "issuer": issuer,
        "live_leaves": live.get(slot.id, 0) if live is not None else UNKNOWN,
        # Agents whose bundle holds this authority, out of every agent that reported.
        "agents_trusting": agents.trusting.get(slot.id, 0) if agents is not None else UNKNOWN,
        "agents_reporting": agents.reporting if agents is not None else UNKNOWN,
    }


def _print(
    state: AuthorityState, live: dict[str, int] | None, agents: Coverage | None, output: str
) -> None:
    rows = slot_rows(state, live, agents)
    unknown = agents.unknown if agents is not None else UNKNOWN
    if output == "json":
        print(json.dumps({"authorities": rows, "agents_unknown": unknown}, indent=2))
        return
    columns = [
        "id",
        "state",
        "tainted",
        "not_before",
        "not_after",
        "live_leaves",
        "agents",
        "issuer",
    ]
    header = [
        "ID",
        "STATE",
        "TAINTED",
        "NOT BEFORE",
        "NOT AFTER",
        "LIVE LEAVES",
        "AGENTS",
        "ISSUER",
    ]
    table = [header] + [[_cell(row, c) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))
    print(
        "AGENTS = agents trusting it / agents reporting; callers sending no report "
        f"(e.g. Istio's agents, counted as unknown): {unknown}"
    )


def _cell(row: dict[str, Any], column: str) -> str:
    if column == "tainted":
        return "yes" if row["tainted"] else "no"
    if column == "agents":
        return f"{row['agents_trusting']}/{row['agents_reporting']}"
    return str(row[column])
