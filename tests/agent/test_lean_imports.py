"""A sidecar agent loads only what its mode needs (issue 12: a lean agent).

Every module an agent imports costs start-up time and resident memory in every pod. The sidecar
needs gRPC, the certificate library, SDS and its metrics; it must not pay for the Kubernetes
client (node mode only), watchdog (only when files are watched on demand: the root file is
polled), pyjwt (only when the identity must be read from the token), the distribution metadata
(only for `--version`) or the CA. Checked in a fresh interpreter, since this test process has
long imported all of them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support.pki import TestCa
from tests.support.processes import child_env

pytestmark = pytest.mark.process  # every test imports in a fresh interpreter

# Top-level packages a pod agent must not load (pyjwt: only to read an unconfigured identity
# from the token), node mode's identity sources (the road by which the Kubernetes client would
# come back in), and the distribution metadata (only `meshca --version` needs it).
_HEAVY = ("kubernetes", "watchdog", "ca_server", "yaml", "jwt")
_NODE_MODE = ("agent.node_identities", "meshca.informer")
_UNNEEDED = ("importlib.metadata",)


def loaded_after(code: str) -> set[str]:
    """Which of `_HEAVY` a fresh interpreter has in `sys.modules` after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout.splitlines()[-1])
    return {
        name
        for name in modules
        if name.split(".")[0] in _HEAVY or name in _NODE_MODE or name in _UNNEEDED
    }


def test_the_sidecar_agent_imports_no_kubernetes_watchdog_or_ca() -> None:
    assert loaded_after("import agent.main") == set()


def test_meshca_agent_through_the_cli_imports_no_kubernetes_watchdog_or_ca() -> None:
    """What `meshca agent ...` loads before the agent runs: the CLI, the agent command's flags,
    then the agent itself."""
    code = (
        "from meshca.cli import build_parser\n"
        "build_parser('agent').parse_args(['agent'])\n"
        "import meshca.commands.agent\n"
        "import agent.main"
    )
    assert loaded_after(code) == set()


def test_the_probe_sees_what_file_watching_loads() -> None:
    """The same probe notices watchdog once a file watcher starts, so the check above can fail."""
    code = (
        "import asyncio\n"
        "from agent.file_mounted import FileWatcher\n"
        "from meshca.clock import SystemClock\n"
        "async def main():\n"
        "    watcher = FileWatcher(clock=SystemClock())\n"
        "    watcher.start()\n"
        "    await watcher.stop()\n"
        "asyncio.run(main())"
    )
    assert {name.split(".")[0] for name in loaded_after(code)} == {"watchdog"}


def test_a_running_sidecar_agent_loads_no_watchdog() -> None:
    """A whole pod agent started and stopped (its root file followed, SDS served, the CA asked
    for a certificate) in a fresh interpreter: the root file is polled, not watched through
    watchdog, and nothing for node mode or the CA is loaded on the way."""
    directory = Path(tempfile.mkdtemp(dir="/tmp", prefix="li-"))
    try:
        (directory / "root-cert.pem").write_text(TestCa(datetime.now(UTC)).root_pem)
        (directory / "token").write_text("token")
        code = (
            "import asyncio\n"
            "from pathlib import Path\n"
            "from agent.config import AgentConfig\n"
            "from agent.main import Agent\n"
            "from meshca.clock import SystemClock\n"
            f"directory = Path({str(directory)!r})\n"
            "config = AgentConfig(\n"
            "    ca_addr='127.0.0.1:1', ca_root_ca=directory / 'root-cert.pem',\n"
            "    namespace='default', service_account='app', token_path=directory / 'token',\n"
            "    sds_socket=directory / 'sds.sock', status_port=0,\n"
            ")\n"
            "async def main():\n"
            "    agent = Agent(config, clock=SystemClock())\n"
            "    await agent.start()\n"
            "    assert agent.certificates.trust_bundle.served is not None  # the root file, read\n"
            "    await asyncio.sleep(0.3)\n"
            "    await agent.stop()\n"
            "asyncio.run(main())"
        )
        assert loaded_after(code) == set()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
