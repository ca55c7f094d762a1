"""`meshca status`: what an agent serves, or how a CA is doing (see `meshca.status_command`)."""

from __future__ import annotations

import argparse

from meshca.status_command import add_status_arguments, run_status_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_status_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_status_command(args)
