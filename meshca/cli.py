"""`meshca` — one command, with a subcommand per program.

This module only dispatches: it knows each subcommand's name, module and one-line help, and
imports the chosen command's module (`meshca.commands.<name>`) only when that command runs, so
`meshca agent` never loads the CA or the Kubernetes client. Each command module turns its flags
into its program's typed configuration in one place (`from_args(args, environ)`) and hands it
over; nothing below reads flags or environment variables again.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

# name -> (module, one-line help); the help is here so `meshca --help` imports no command.
COMMANDS: dict[str, tuple[str, str]] = {
    "ca": ("meshca.commands.ca", "run the certificate authority (Istio's CA API)"),
    "token": (
        "meshca.commands.token",
        "mint a development service-account token the local CA trusts",
    ),
    "inspect": ("meshca.commands.inspect", "describe PEM certificates"),
    "authority": (
        "meshca.commands.authority",
        "show or change the CA's authorities (prepare, activate, taint, revoke)",
    ),
    "agent": ("meshca.commands.agent", "run the per-pod agent (certificates, SDS, files)"),
    "up": ("meshca.commands.up", "run a local CA and one agent, for trying meshca"),
    "status": (
        "meshca.commands.status",
        "certificates an agent serves, or a CA's expiry, rates and leaves",
    ),
}


def _load(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name][0])


def installed_version() -> str:
    """The version of the installed distribution: what a bug report needs. A source tree run
    without installing has no distribution metadata, and says so rather than guessing."""
    import importlib.metadata  # only for --version: it scans sys.path for distributions

    try:
        return importlib.metadata.version("meshca")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a usage error is one line: what is wrong and where the
    help is (the usage dump of a command with forty flags buries the line that matters)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


class _VersionAction(argparse.Action):
    """`--version`, looking the version up only when asked (argparse's own `version` action
    needs the string up front, and every `meshca agent` would pay for the lookup)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        print(f"{parser.prog} {installed_version()}")  # to stdout, as argparse's own does
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (`only`) one whose other subcommands have no flags loaded (`""`:
    none, enough for `meshca --help` and `--version`)."""
    parser = _Parser(prog="meshca", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", action=_VersionAction)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (_, summary) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=summary)
        if only is None or only == name:
            _load(name).add_arguments(sub)
    return parser


# What a shell reports for a Unix tool killed by SIGPIPE (`cat big | head -1`: 128 + 13).
CLOSED_STDOUT_EXIT = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; its exit status.

    A reader that closes the pipe early (`meshca authority show | head -1`) ends the command
    the way it ends `cat` or `ls`: quietly, with status 141 (what the shell shows for a tool
    killed by SIGPIPE, and what `set -o pipefail` scripts already expect from them), not with
    a `BrokenPipeError` traceback. Python ignores SIGPIPE, so the write raises instead; it is
    caught here, for every command, and stdout is pointed at /dev/null so the interpreter's
    last flush of what is still buffered does not raise again. A broken pipe that is not
    stdout's (a socket a command writes to) is an error like any other and is raised."""
    try:
        try:
            return _run(list(sys.argv[1:] if argv is None else argv))
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        _discard_stdout()
        return CLOSED_STDOUT_EXIT


def _run(args_list: list[str]) -> int:
    chosen = args_list[0] if args_list and args_list[0] in COMMANDS else ""
    args = build_parser(chosen).parse_args(args_list)
    args.argv = args_list  # `meshca ca` starts its worker processes with the same arguments
    return int(_load(args.command).run(args))


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) nobody reads any more: the kernel reports an error
    condition on its write end (POLLERR), or a hang-up."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Points file descriptor 1 at /dev/null (it stays open: whatever is still buffered is
    written there at exit). Nothing to do when stdout is no real file (a test's capture)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
