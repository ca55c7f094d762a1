"""`meshca ... | head -1`: a reader that closes the pipe early ends every command the way it ends
`cat` or `ls` — quietly, status 141 — never with a `BrokenPipeError` traceback.

Each case runs the real `meshca` in a child process whose stdout is a pipe whose read end is
already closed, so its first write fails, every time (no race with a reader's timing)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from ca_server.authority.state_store import LocalAuthorityStateStore, SlotFactory
from ca_server.dev_issuer import ensure_dev_issuer
from certs import KeySpec
from meshca.cli import CLOSED_STDOUT_EXIT, COMMANDS
from meshca.clock import SystemClock
from tests.support.processes import child_env

pytestmark = pytest.mark.process  # every test runs `meshca`


def _run_into_closed_pipe(*args: str, unbuffered: bool = False) -> subprocess.CompletedProcess[str]:
    """`meshca ARGS` with a stdout nobody reads: its read end closed before the start."""
    env = child_env()
    if not unbuffered:  # as users run it: stdout buffered, the failure shows at the flush
        del env["PYTHONUNBUFFERED"]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "meshca", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)


def _assert_quiet(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert "BrokenPipeError" not in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


def _assert_quiet_sigpipe_exit(result: subprocess.CompletedProcess[str]) -> None:
    _assert_quiet(result)
    assert result.returncode == CLOSED_STDOUT_EXIT == 141, result.stderr


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a first `meshca ca` start leaves: one active authority, its root-cert.pem, and the
    development issuer `meshca token` signs with."""
    directory = tmp_path_factory.mktemp("data")
    directory.chmod(0o700)
    factory = SlotFactory(KeySpec(), "cluster.local", timedelta(days=30))
    LocalAuthorityStateStore(directory, factory, SystemClock()).read()
    ensure_dev_issuer(directory)
    return directory


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_commands_help_into_a_closed_pipe_exits_quietly(command: str) -> None:
    """argparse drops a help text it could not write (`_print_message` ignores OSError) and
    exits 0; what it leaves buffered (a help shorter than the buffer) fails at meshca's flush:
    141. Either way, no traceback."""
    result = _run_into_closed_pipe(*filter(None, [command, "--help"]))
    _assert_quiet(result)
    assert result.returncode in (0, CLOSED_STDOUT_EXIT), result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--version",),
        ("authority", "show"),
        ("authority", "show", "-o", "json"),
        ("status",),
        ("inspect", "root-cert.pem"),
        ("token", "--namespace", "default", "--service-account", "sleep"),
    ],
    ids=lambda args: " ".join(args),
)
def test_a_command_whose_output_nobody_reads_exits_quietly(
    data_dir: Path, args: tuple[str, ...]
) -> None:
    if args[0] == "inspect":
        args = ("inspect", str(data_dir / args[1]))
    elif args[0] != "--version":
        args = (*args, "--data-dir", str(data_dir))
    _assert_quiet_sigpipe_exit(_run_into_closed_pipe(*args))


def test_unbuffered_output_into_a_closed_pipe_exits_quietly(data_dir: Path) -> None:
    """PYTHONUNBUFFERED: the write itself fails, in the middle of the command."""
    result = _run_into_closed_pipe(
        "authority", "show", "--data-dir", str(data_dir), unbuffered=True
    )
    _assert_quiet_sigpipe_exit(result)
