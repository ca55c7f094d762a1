"""`meshca authority show ID --agents`: the pods behind the coverage figures of one authority
(`ca_server.authority.agent_stragglers`), beside the slots table or under `agents` in `-o json`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ca_server.authority import (
    AuthorityCommandError,
    AuthorityState,
    agents_section,
    render_agents,
)
from ca_server.fleet import FleetReports
from meshca.commands.authority_view import render_authorities


def agents_listing(
    args: argparse.Namespace, state: AuthorityState, fleet: FleetReports | None
) -> dict[str, Any] | None:
    """The `agents` section when `--agents` was asked for (with `show ID`), else `None`."""
    if not getattr(args, "agents", False):
        return None
    if args.verb != "show" or args.id is None:
        raise AuthorityCommandError(
            "--agents lists the pods of one authority: use `meshca authority show ID --agents`"
        )
    section = agents_section(state, fleet, state.find(args.id).id)
    return section if section is not None else {"unknown": True}


def render_shown(
    args: argparse.Namespace, shown: dict[str, Any], listing: dict[str, Any] | None
) -> str:
    if args.output == "json":
        return json.dumps({**shown, "agents": listing} if listing is not None else shown, indent=2)
    text = render_authorities(shown)
    if listing is None:
        return text
    return text + "\n\n" + render_agents(None if listing.get("unknown") else listing)
