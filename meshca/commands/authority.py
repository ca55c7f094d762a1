"""`meshca authority show|prepare|activate|taint|revoke [ID] [-o json] [--jwt]` — the operator's
hands on the CA's authority slots (with `--jwt`: its JWT-SVID signing keys,
`meshca.commands.authority_jwt`), through the same shared state the CA processes watch.

Every change is one store transaction (the data directory's lock, or the Secret's
resourceVersion), audited on stderr, and reaches every running CA process within its poll
interval. Refusals (`AuthorityCommandError`) say why and what to do; nothing is written then.
Everything it needs of the CA comes from the authority facade (`ca_server.authority`).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta

from ca_server.authority import (
    AuthorityCommandError,
    AuthorityState,
    AuthorityStateStore,
    CaSetupError,
    Phase,
    SlotFactory,
    audit_events,
    fleet_coverage,
    longest_leaf,
    refuse_short_lifetime,
    refuse_unfit,
    show_document,
)
from certs import DEFAULT_TRUST_DOMAIN, CertsError, KeySpec
from meshca.commands.authority_agents import agents_listing, render_shown
from meshca.commands.authority_view import (
    Target,
    add_target_arguments,
    no_authorities_message,
    open_target,
    read_fleet,
    read_live_leaves,
    taint_or_revoke,
)
from meshca.durations import parse_duration
from meshca.logs import configure_logging

_VERBS = ("show", "prepare", "activate", "taint", "revoke")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("verb", choices=_VERBS)
    parser.add_argument(
        "id", nargs="?", default=None, help="authority ID (Subject Key ID hex, or a prefix)"
    )
    add_target_arguments(parser, parser.add_mutually_exclusive_group(required=True))
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
    parser.add_argument(
        "--max-workload-cert-ttl",
        default=None,
        help="prepare/activate: the CA's --max-workload-cert-ttl, if not the default 90d (an "
        "authority must outlive the longest workload certificate: docs/rotate-the-ca.md)",
    )
    parser.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN)
    parser.add_argument(
        "--agents",
        action="store_true",
        help="show ID: also list the pods that do not trust it yet and those still serving a "
        "leaf it signed (namespace/name, identity, node, last report)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="revoke: even while reporting agents still serve leaves the authority signed, or "
        "when their reports cannot be read (those leaves stop verifying); activate --jwt: "
        "before the key was published for --jwks-max-age",
    )
    parser.add_argument(
        "--jwt",
        action="store_true",
        help="the JWT-SVID signing keys instead of the X.509 authorities (ID: a key's kid)",
    )
    parser.add_argument(
        "--jwks-max-age",
        default="5m",
        help="activate --jwt: the CA's --jwks-max-age (how long relying parties cache the JWKS)",
    )


def run(args: argparse.Namespace) -> int:
    configure_logging("WARNING", audit_stream=sys.stderr)
    if args.jwt:
        from meshca.commands.authority_jwt import run_jwt

        return run_jwt(args)
    name = f"meshca authority {args.verb}"
    try:
        spec = KeySpec.parse(args.root_key)
        lifetime = parse_duration(args.root_ttl) if args.root_ttl is not None else None
        max_ttl = _max_workload_ttl(args.max_workload_cert_ttl)
    except (CertsError, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    try:
        # Without --root-ttl, `prepare` gives the new authority the active one's lifetime; the
        # store's factory only makes a first authority, which this command never does.
        factory = SlotFactory(spec, args.trust_domain, lifetime or timedelta(days=3650))
        with open_target(args, factory, "meshca-authority") as target:
            if not target.exists:
                print(f"{name}: {no_authorities_message(target)}", file=sys.stderr)
                return 2
            shown_state = None
            if args.verb == "show":
                state = target.store.read()
                if args.id is not None:
                    # Coverage is computed over every authority (an agent's digest names a
                    # subset of all of them); only what is printed is narrowed.
                    shown_state = state.only(args.id)
            else:
                if args.verb == "revoke" and not args.force:
                    _refuse_revoke_while_served(args.id, target, name)
                state = _change(args, target.store, factory, lifetime, max_ttl, name)
            live = read_live_leaves(target.ledgers, name)
            fleet = read_fleet(target.ledgers, name)
            agents = fleet_coverage(state, fleet)
            listing = agents_listing(args, state, fleet)
    except AuthorityCommandError as exc:
        print(f"{name}: refused: {exc}", file=sys.stderr)
        return 3
    except CaSetupError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    shown = show_document(shown_state or state, live, agents)
    print(render_shown(args, shown, listing))
    return 0


def _max_workload_ttl(text: str | None) -> timedelta | None:
    if text is None:
        return None
    value = parse_duration(text)
    if value <= timedelta(0):
        raise ValueError(f"--max-workload-cert-ttl {text!r} must be longer than 0s (the CA's)")
    return value


def _refuse_revoke_while_served(ident: str | None, target: Target, name: str) -> None:
    """Revoke removes the authority from every bundle at once: a leaf it signed that an agent
    still serves stops verifying. Refused while the agents' reports say any serves one, or
    cannot be read (unknown is not none); `--force` overrides. Agents that send no report
    (Istio's) cannot be counted here: `show`'s unknown callers say how many there are."""
    if ident is None:
        return  # `_change` says the ID is missing
    state = target.store.read()
    slot = state.find(ident)
    agents = fleet_coverage(state, read_fleet(target.ledgers, name))
    if agents is None or agents.dropped or agents.unreadable:
        why = (
            "cannot read the agents' reports"
            if agents is None
            else "some reports were left out or cannot be read"
        )
        raise AuthorityCommandError(
            f"{why}, so cannot tell whether any agent still serves a leaf {slot.id} signed; "
            "fix that, or pass --force"
        )
    serving = agents.serving.get(slot.id, 0)
    if serving:
        raise AuthorityCommandError(
            f"{serving} reporting agent(s) still serve a leaf {slot.id} signed, and it would stop "
            "verifying: wait for `show` to report SERVING 0 (agents re-sign within "
            "--taint-resign-window of the taint), or pass --force"
        )


def _change(
    args: argparse.Namespace,
    store: AuthorityStateStore,
    factory: SlotFactory,
    lifetime: timedelta | None,
    max_ttl: timedelta | None,
    name: str,
) -> AuthorityState:
    now = datetime.now(UTC)
    before: list[AuthorityState] = []

    def change(state: AuthorityState) -> AuthorityState:
        before[:] = [state]
        if args.verb == "prepare":
            life = lifetime if lifetime is not None else state.active.lifetime
            refuse_short_lifetime(life, longest_leaf(state, max_ttl))
            maker = SlotFactory(factory.key_spec, factory.trust_domain, life)
            return state.prepare(lambda: maker.new(now, Phase.PREPARED), now, "operator")
        if args.verb == "activate":
            activated = state.activate(args.id, now, "operator")
            refuse_unfit(activated.active, now, longest_leaf(state, max_ttl))
            return activated
        needs = f"`{name}` needs the authority ID (see `show`)"
        return taint_or_revoke(state, args.verb, args.id, now, needs)

    state = store.transact(change)
    seen = set(before[0].history) if before else set()
    audit_events(tuple(e for e in state.history if e not in seen), "meshca authority")
    return state
