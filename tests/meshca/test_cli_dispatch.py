"""`meshca` loads only the chosen command: the agent never imports the CA or `kubernetes`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshca import cli
from meshca.cli import COMMANDS, build_parser

PROBE = """
import sys
from meshca.cli import build_parser, _load
args = build_parser("agent").parse_args(["agent", "--ca-addr", "127.0.0.1:1"])
_load(args.command)
import agent.main  # what `run` imports when the agent starts
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("ca_server", "kubernetes"))
print(",".join(loaded))
"""


@pytest.mark.process
def test_agent_command_imports_neither_the_ca_nor_kubernetes():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "", f"meshca agent loaded: {result.stdout.strip()}"


def test_help_lists_every_command_with_only_one_loaded():
    parser = build_parser("inspect")
    text = parser.format_help()
    for name in COMMANDS:
        assert name in text
    args = parser.parse_args(["inspect", "a.pem"])
    assert args.command == "inspect"


def test_a_broken_pipe_that_is_not_stdouts_is_still_an_error(monkeypatch: pytest.MonkeyPatch):
    """Only a stdout nobody reads ends a command quietly (tests/meshca/test_cli_closed_stdout.py);
    a socket a command writes to breaking is an error like any other."""

    def peer_hung_up(args_list: list[str]) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_run", peer_hung_up)
    with pytest.raises(BrokenPipeError):
        cli.main(["status", "unix:/nowhere"])
