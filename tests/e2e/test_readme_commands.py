"""The README's two Quickstart commands, exactly as written: `make up` and `make test`.

`make test` is what CI runs (`.ci/run`), so a green CI shows the second; this file checks the
README still says so and runs the first. `make up` uses the repository's `.venv`, which
`make test` has just installed in CI; where it is absent (running pytest from another
environment) that test is skipped rather than installing a virtualenv from inside a test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from certs import describe_certificate, load_cert
from tests.support.processes import REPO_ROOT, wait_for

IDENTITY = "spiffe://cluster.local/ns/default/sa/default"


def _quickstart_commands() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the Quickstart has a sh code block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_quickstart_is_two_commands_and_ci_runs_the_second():
    assert _quickstart_commands() == ["make up", "make test"]
    ci = [
        line.strip()
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ci[-1] == "make test"


@pytest.mark.skipif(
    not (REPO_ROOT / ".venv" / ".installed").exists(),
    reason="`make up` runs from the repository's .venv, which `make test` installs (as in CI)",
)
@pytest.mark.process  # runs `make up`: the CA and an agent
@pytest.mark.timeout(120)
def test_make_up_serves_a_certificate_and_stops_on_ctrl_c():
    workdir = Path(tempfile.mkdtemp(dir="/tmp", prefix="mkup-"))
    up_args = f"--dir {workdir / 'meshca'} --secret-ttl 30s --status-listen 127.0.0.1:0"
    proc = subprocess.Popen(
        ["make", "-s", "up", f"UP_ARGS={up_args}"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so Ctrl-C can be simulated
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        chain = workdir / "meshca" / "certs" / "cert-chain.pem"
        wait_for(lambda: any("Ctrl-C to stop" in line for line in lines), 60, "the banner")
        wait_for(chain.exists, 30, "the certificate files")
        assert describe_certificate(load_cert(chain.read_bytes())).identity == IDENTITY
        assert any(str(workdir / "meshca" / "sds.sock") in line for line in lines)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        started = time.monotonic()
        try:
            proc.wait(15)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert time.monotonic() - started < 10
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of `make up` (make, meshca up, its CA) is left
