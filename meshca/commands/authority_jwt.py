"""`meshca authority show|prepare|activate|taint|revoke [KID] --jwt --data-dir D` — the same verbs
on the JWT-SVID signing keys (`ca_server.jwt_svid`), in the same data directory the CA processes
share (`jwt-authority.json`, under the data directory's lock).

The rules are the X.509 authority's (only a prepared key activates, only an old one is tainted,
only a tainted one is revoked) plus the one relying parties need: `activate` refuses a key
published for less than `--jwks-max-age` (the CA's; they may still hold a JWKS without it) unless
`--force`. A taint reaches the agents within their bundle poll: they drop the tokens it signed.
`show` gives each key's coverage — how many of the agents holding a JWT bundle report holding
it (`ca_server.fleet.jwt_coverage`, from every CA process's published reports) — and why a due
activation waits, if it does.
With `--kubeconfig` (Kubernetes mode) the keys are in Secret `meshca-jwt-keys` of
`--namespace`, changed with the resourceVersion read (as the CA replicas change it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from ca_server.authority import AuthorityCommandError, CaSetupError, Phase, SlotFactory
from ca_server.fleet import AgentCoverage, jwt_coverage
from ca_server.jwt_svid import (
    JWT_STATE_FILE,
    JwtKeyFactory,
    JwtKeyState,
    JwtKeyStore,
    LocalJwtKeyStore,
    cluster_jwt_key_store,
    key_rows,
)
from certs import DEFAULT_TRUST_DOMAIN, KeySpec
from meshca.clock import SystemClock
from meshca.commands.authority_view import open_target, read_fleet, taint_or_revoke
from meshca.durations import parse_duration
from meshca.logs import audit


def run_jwt(args: argparse.Namespace) -> int:
    name = f"meshca authority {args.verb} --jwt"
    try:
        max_age = parse_duration(args.jwks_max_age)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    try:
        with _open_store(args) as store:
            if store is None:
                print(
                    f"{name}: no JWT-SVID keys there yet (a CA creates them at its first start)",
                    file=sys.stderr,
                )
                return 2
            state = store.read() if args.verb == "show" else _change(args, store, max_age, name)
        coverage = _coverage(args, state, name)
    except AuthorityCommandError as exc:
        print(f"{name}: refused: {exc}", file=sys.stderr)
        return 3
    except CaSetupError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    print(_render(state, coverage, args.output))
    return 0


def _coverage(
    args: argparse.Namespace, state: JwtKeyState, name: str
) -> dict[str, AgentCoverage] | None:
    """Each key's coverage from every CA process's agent reports (None: unreadable, said on
    stderr), where the X.509 slots' `show` reads them."""
    # Only the reports are read: the factory would make a first X.509 authority, never done here.
    unused = SlotFactory(KeySpec(), DEFAULT_TRUST_DOMAIN, timedelta(days=1))
    with open_target(args, unused, "meshca-authority") as target:
        fleet = read_fleet(target.ledgers, name)
    if fleet is None:
        return None
    return {key.kid: jwt_coverage(key.kid, fleet) for key in state.keys}


@contextlib.contextmanager
def _open_store(args: argparse.Namespace) -> Iterator[JwtKeyStore | None]:
    """The keys' store named by `--data-dir` or `--kubeconfig`; None when it holds no keys (a
    command never creates the first key: a CA does)."""
    # The factory only makes a first key, which the existence check rules out here.
    unused = JwtKeyFactory("ES256", timedelta(days=1))
    if args.data_dir is not None:
        exists = (args.data_dir / JWT_STATE_FILE).exists()
        yield LocalJwtKeyStore(args.data_dir, unused, SystemClock()) if exists else None
        return
    with cluster_jwt_key_store(
        args.kubeconfig, args.namespace, unused, SystemClock(), "meshca-authority"
    ) as store:
        yield store if store.exists() else None


def _change(
    args: argparse.Namespace, store: JwtKeyStore, max_age: timedelta, name: str
) -> JwtKeyState:
    now = datetime.now(UTC)
    before: list[JwtKeyState] = []

    def change(state: JwtKeyState) -> JwtKeyState:
        before[:] = [state]
        if args.verb == "prepare":
            active = state.active
            maker = JwtKeyFactory(active.algorithm, active.lifetime)
            return state.prepare(lambda: maker.new(now, Phase.PREPARED), now, "operator")
        if args.verb == "activate":
            target = state.find(args.id) if args.id else state.prepared
            if target is not None and target.phase is Phase.PREPARED and not args.force:
                published = now - target.created_at
                if published < max_age:
                    raise AuthorityCommandError(
                        f"JWT key {target.kid} has been published for {published}, less than "
                        f"--jwks-max-age {max_age}: relying parties may still hold a JWKS "
                        "without it; wait, or pass --force"
                    )
            return state.activate(args.id, now, "operator")
        needs = f"`{name}` needs the key's kid (see `show --jwt`)"
        return taint_or_revoke(state, args.verb, args.id, now, needs)

    state = store.transact(change)
    seen = set(before[0].history) if before else set()
    for event in state.history:
        if event not in seen:
            audit("jwt-key", outcome=event.event, kid=event.kid, by="meshca authority")
    return state


def _render(state: JwtKeyState, coverage: dict[str, AgentCoverage] | None, output: str) -> str:
    rows = key_rows(state, coverage)
    waiting = state.gate_waiting()
    if output == "json":
        shown = {"jwt_keys": rows, "activation_waiting": waiting.reason if waiting else None}
        return json.dumps(shown, indent=1)
    lines = [f"{'KID':<44} {'ALG':<6} {'PHASE':<9} {'TAINTED':<8} {'EXPIRES':<26} AGENTS"]
    lines += [
        f"{r['kid']!s:<44} {r['algorithm']!s:<6} {r['phase']!s:<9} "
        f"{'yes' if r['tainted'] else 'no':<8} {_seconds(str(r['expires_at'])):<26} "
        f"{r['agents']['text'] if 'agents' in r else 'unknown'}"
        for r in rows
    ]
    if waiting is not None:
        lines.append(f"activation of the prepared key: {waiting.reason}")
    return "\n".join(lines)


def _seconds(when: str) -> str:
    """An ISO 8601 time as the table shows it: to the second."""
    return datetime.fromisoformat(when).isoformat(timespec="seconds")
