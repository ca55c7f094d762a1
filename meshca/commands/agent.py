"""`meshca agent`: run the per-pod (or per-node) agent: certificates, SDS, files.

Imports only `agent.config` until it runs; `agent.main` (and, in node mode watching pods,
`kubernetes`) load when the agent starts, never `ca_server`.
"""

from __future__ import annotations

import argparse

from agent.config import add_agent_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_agent_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from agent.main import run_agent_command

    return run_agent_command(args)
