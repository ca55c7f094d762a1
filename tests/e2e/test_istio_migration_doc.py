"""docs/istio-migration.md's commands, exactly as written, against a local CA (`meshca up`'s
kind: a `meshca ca` on loopback trusting its development issuer, agents started from the CLI).

Every ```sh block of the page runs, in order, in one `bash -euo pipefail`; the only inputs are
the variables the page itself lets the reader change (`DEMO`, `TLS`, `MTLS`, `MON`, `DEBUG`),
set here to a short private directory and free ports so runs in parallel do not collide. The
walk-through renews over mTLS as a `PROV_CERT` agent with no token, and shows the strict CSR
check; the test then reads the CA's audit lines for both, and checks nothing the page started
is left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT, child_env, free_port

pytestmark = pytest.mark.process  # runs the commands of the migration guide

PAGE = REPO_ROOT / "docs" / "istio-migration.md"


def page_commands() -> str:
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) >= 4, "the walk-through's sh blocks"
    return "\n".join(blocks)


@pytest.fixture
def demo_dir() -> Iterator[Path]:
    """Short: the agents' SDS sockets live in it (paths <= 107 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mig-") as path:
        yield Path(path) / "demo"


def _audit(ca_log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in ca_log.read_text().splitlines() if line.startswith("{")]


@pytest.mark.timeout(120)
def test_the_migration_walkthrough_runs_as_written(demo_dir: Path):
    meshca_bin = Path(sys.executable).parent
    assert (meshca_bin / "meshca").exists(), "the `meshca` command of this environment"
    env = child_env(
        {
            "PATH": f"{meshca_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "DEMO": str(demo_dir),
            "TLS": f"127.0.0.1:{free_port()}",
            "MTLS": f"127.0.0.1:{free_port()}",
            "MON": f"127.0.0.1:{free_port()}",
            "DEBUG": f"127.0.0.1:{free_port()}",
        }
    )
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", page_commands()],
        cwd=demo_dir.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: whatever it left running is stopped
    )
    try:
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        deadline = time.monotonic() + 10
        leftover = True
        while leftover and time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
            except ProcessLookupError:
                leftover = False
        if leftover:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-3000:]
    assert not leftover, "the page's `kill`s stop everything it started"

    audit = _audit(demo_dir / "ca.log")
    renewed = [line for line in audit if line.get("authenticator") == "client-certificate"]
    assert renewed and renewed[0]["identity"] == "spiffe://cluster.local/ns/default/sa/sleep"
    assert renewed[0]["caller"] == "x509:spiffe://cluster.local/ns/default/sa/sleep"
    refused = [line for line in audit if line.get("reason") == "csr-identity-mismatch"]
    assert refused and refused[0]["code"] == "PERMISSION_DENIED"
    assert "spiffe://cluster.local/ns/default/sa/sleep" in output  # `meshca inspect`'s identity
