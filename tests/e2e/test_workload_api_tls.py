"""mTLS between two processes that take their identities from their own agents' Workload API,
on py-spiffe's `X509Source` (the client dials with `spiffe-tls`; the server builds a pyOpenSSL
context per connection, since spiffe-tls 0.4.0's `listen()` cannot rotate under pyOpenSSL 26:
`tests.support.spiffe_tls_peer.server_context`): each verifies the other's SPIFFE ID, and the
connections keep succeeding while both agents rotate (8 s leaves, renewed every ~4 s)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess
from tests.support.ca_process import CaProcess
from tests.support.processes import child_env, free_port

pytestmark = pytest.mark.process  # runs a CA, an agent and SPIFFE TLS peers

CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/default/sa/server"
DIAL_SECONDS = 11  # long enough for both agents to rotate at least twice


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="wtls-"))
    yield path
    if not os.environ.get("MESHCA_KEEP_TEST_DIRS"):
        shutil.rmtree(path, ignore_errors=True)


def peer(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.spiffe_tls_peer", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        text=True,
    )


def server_log(process: subprocess.Popen[str]) -> str:
    stop(process)
    out, err = process.communicate()
    return f"{out}\n{err[-3000:]}"


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


def test_spiffe_tls_peers_verify_each_other_across_rotations(
    workdir: Path, request: pytest.FixtureRequest
) -> None:
    ca = CaProcess(workdir / "ca")
    request.addfinalizer(ca.stop)
    ca.start()
    sockets = {}
    for name in ("server", "client"):
        sockets[name] = workdir / name / "spiffe.sock"
        agent = AgentProcess(
            workdir,
            ca,
            name,
            secret_ttl="8s",
            extra_args=("--workload-api-socket", str(sockets[name])),
        )
        request.addfinalizer(agent.stop)
        agent.start()
    address = f"127.0.0.1:{free_port()}"
    server = peer("serve", str(sockets["server"]), address, CLIENT_ID)
    request.addfinalizer(lambda: stop(server))
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "listening", server.stderr

    # A client that expects another identity refuses the server: the ID check is real.
    impostor_check = peer("dial", str(sockets["client"]), address, CLIENT_ID, "0.1")
    out, err = impostor_check.communicate(timeout=60)
    (refused,) = [json.loads(line) for line in out.splitlines()]
    assert "error" in refused, refused

    client = peer("dial", str(sockets["client"]), address, SERVER_ID, str(DIAL_SECONDS))
    out, err = client.communicate(timeout=DIAL_SECONDS + 60)
    assert client.returncode == 0, err
    results = [json.loads(line) for line in out.splitlines()]
    failures = [r for r in results if "error" in r]
    assert not failures, (len(failures), len(results), failures[:2], server_log(server))
    assert len(results) >= 20
    server_serials = {r["seen_server_serial"] for r in results}
    client_serials_seen_by_server = {r["answer"]["client_serial"] for r in results}
    # Both identities rotated while the connections kept succeeding.
    assert len(server_serials) >= 2, server_serials
    assert len(client_serials_seen_by_server) >= 2, client_serials_seen_by_server
