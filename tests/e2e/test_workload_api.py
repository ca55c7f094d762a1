"""The SPIFFE Workload API of a real `meshca agent` (sidecar mode) against a real `meshca ca`,
driven by the real PyPI `spiffe` client (py-spiffe's `WorkloadApiClient`).

- The client fetches its X.509-SVID: the pod's SPIFFE ID, a chain that verifies to the bundle
  that came with it, a key that matches the leaf; then, on ONE stream (`retry_connect=False`:
  a stream end would be an error, not a reconnect), at least two rotations pushed; then
  `meshca authority prepare` changes the trust bundle and that change is pushed without a new
  leaf, on the SVID stream and on a `FetchX509Bundles` stream.
- SDS, the output files and the Workload API serve the same leaf at the same moment (one
  cache): serials compared across all three after a rotation.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from spiffe._proto import workload_pb2, workload_pb2_grpc

from certs import load_certs
from tests.support.agent_process import AgentProcess
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.processes import wait_for
from tests.support.sds_client import fetch_secrets, leaf_serial
from tests.support.status_cli import meshca_status, status_json
from tests.support.workload_api import SvidWatch, bundle_serials, client_for

pytestmark = pytest.mark.process  # every test runs a CA, an agent and Workload API clients

SECRET_TTL = "8s"  # the agent renews every ~4 s
STREAMS = "meshca_agent_workload_api_streams"
RESPONSES = "meshca_agent_workload_api_responses_total"


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short directory (Unix socket paths <= 107 bytes), kept with MESHCA_KEEP_TEST_DIRS."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="wapi-"))
    yield path
    if not os.environ.get("MESHCA_KEEP_TEST_DIRS"):
        shutil.rmtree(path, ignore_errors=True)


def start_agent(
    workdir: Path, ca: CaProcess, request: pytest.FixtureRequest
) -> tuple[AgentProcess, Path]:
    """A sidecar-mode agent serving the Workload API; (the agent, its Workload API socket)."""
    socket = workdir / "spiffe" / "agent.sock"
    agent = AgentProcess(
        workdir,
        ca,
        "app",
        secret_ttl=SECRET_TTL,
        extra_args=("--workload-api-socket", f"unix://{socket}"),
    )
    request.addfinalizer(agent.stop)
    agent.start()
    return agent, socket


class BundleStream:
    """`FetchX509Bundles` on one stream (py-spiffe's own generated stub and the header its
    client sends): every bundle pushed, as sets of root serials."""

    def __init__(self, socket: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        stub = workload_pb2_grpc.SpiffeWorkloadAPIStub(self.channel)
        self.call = stub.FetchX509Bundles(
            workload_pb2.X509BundlesRequest(), metadata=(("workload.spiffe.io", "true"),)
        )
        self.bundles: list[frozenset[int]] = []
        self.ended: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                ((trust_domain, bundle),) = response.bundles.items()
                assert trust_domain == "spiffe://cluster.local"
                self.bundles.append(bundle_serials(trust_domain, bundle))
        except grpc.RpcError as exc:
            self.ended = exc

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
        self.thread.join(5)


def test_py_spiffe_client_sees_rotations_and_a_bundle_change_on_one_stream(
    workdir: Path, request: pytest.FixtureRequest
) -> None:
    ca = CaProcess(workdir / "ca", "--ca-reload-interval", "500ms")
    request.addfinalizer(ca.stop)
    ca.start()
    agent, socket = start_agent(workdir, ca, request)
    assert oct(socket.stat().st_mode & 0o777) == "0o600"

    # One fetch, as an application does at start-up.
    with client_for(socket) as client:
        svid = client.fetch_x509_svid()
        assert str(svid.spiffe_id) == agent.identity
    watch = SvidWatch(socket)
    request.addfinalizer(watch.close)
    bundles = BundleStream(socket)
    request.addfinalizer(bundles.close)

    first = watch.next(timeout=10)
    assert first.spiffe_id == agent.identity
    assert first.key_matches
    assert first.chain_verifies()
    assert first.roots == {int(c.serial_number) for c in load_certs(ca.root_cert_path.read_bytes())}

    # Two rotations pushed on the same stream: new leaves, each verifying, each with its key.
    seen = [first.serial]
    while len(set(seen)) < 3:
        pushed = watch.next(timeout=15)
        assert pushed.spiffe_id == agent.identity
        assert pushed.key_matches and pushed.chain_verifies()
        seen.append(pushed.serial)
    assert not watch.errors

    # A new root prepared: the bundle grows to {old, new}; no CSR is needed for that.
    old_roots = watch.pushed[-1].roots
    result = meshca_authority(data_dir_target(ca.data_dir), "prepare")
    assert result.returncode == 0, result.stderr
    before = len(watch.pushed)
    while True:
        pushed = watch.next(timeout=20)
        if pushed.roots != old_roots:
            break
    assert len(pushed.roots) == 2 and old_roots < pushed.roots
    index = watch.pushed.index(pushed)
    assert index >= before
    previous = watch.pushed[index - 1]
    # The push that brought the bundle carries the leaf the stream already had.
    assert pushed.serial == previous.serial, "the bundle change came with a new leaf"
    assert pushed.key_matches and pushed.chain_verifies()
    wait_for(lambda: bool(bundles.bundles) and bundles.bundles[-1] == pushed.roots, 10,
             "the FetchX509Bundles stream to push the new bundle")  # fmt: skip
    assert bundles.bundles[0] == old_roots and bundles.ended is None
    assert not watch.errors

    metrics = agent.metrics()
    # Both streams still open (the one-shot fetch's is closed), every push counted.
    assert sample_value(metrics, STREAMS, {"rpc": "FetchX509SVID"}) == 1
    assert sample_value(metrics, STREAMS, {"rpc": "FetchX509Bundles"}) == 1
    responses = sample_value(metrics, RESPONSES, {"rpc": "FetchX509SVID"})
    assert responses >= len(watch.pushed) + 1


def test_sds_files_and_workload_api_serve_the_same_leaf_after_a_rotation(
    workdir: Path, request: pytest.FixtureRequest
) -> None:
    ca = CaProcess(workdir / "ca")
    request.addfinalizer(ca.stop)
    ca.start()
    agent, socket = start_agent(workdir, ca, request)
    with client_for(socket) as client:
        first = int(client.fetch_x509_svid().leaf.serial_number)

        def workload_api_serial() -> int:
            return int(client.fetch_x509_svid().leaf.serial_number)

        wait_for(lambda: workload_api_serial() != first, 15, "a rotation")
        # A reading counts only when no rotation fell between its two Workload API reads.
        for _ in range(20):
            before = workload_api_serial()
            sds = leaf_serial(fetch_secrets(agent.sds_socket, ["default"])["default"])
            files = agent.file_serial()
            after = workload_api_serial()
            if before == after:
                break
        else:  # pragma: no cover - 20 rotations inside three reads
            raise AssertionError("could not read the three outputs between two rotations")
    assert before != first
    assert sds == before and files == before, {"workload_api": before, "sds": sds, "files": files}


def test_meshca_status_shows_what_the_workload_api_serves(
    workdir: Path, request: pytest.FixtureRequest
) -> None:
    """`meshca status unix:<workload API socket>` asks as an application would and prints the
    SVID and bundle rows (no key); the agent's status address shows the Workload API's streams,
    responses and refusals."""
    ca = CaProcess(workdir / "ca")
    request.addfinalizer(ca.stop)
    ca.start()
    agent, socket = start_agent(workdir, ca, request)
    for _ in range(20):
        with client_for(socket) as client:
            before = int(client.fetch_x509_svid().leaf.serial_number)
            document = status_json(f"unix:{socket}")
            after = int(client.fetch_x509_svid().leaf.serial_number)
        if before == after:
            break
    assert document["source"] == "workload-api"
    rows = {entry["resource_name"]: entry for entry in document["secrets"]}
    assert set(rows) == {agent.identity, "spiffe://cluster.local bundle"}
    assert rows[agent.identity]["type"] == "cert_chain"
    assert int(rows[agent.identity]["serial"], 16) == before
    assert rows["spiffe://cluster.local bundle"]["type"] == "ca"
    table = meshca_status(f"unix:{socket}")
    assert table.returncode == 0 and agent.identity in table.stdout
    assert "PRIVATE KEY" not in table.stdout + json.dumps(document)

    # A call without the security header, refused and counted, shows in the agent's status.
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stream = channel.unary_stream("/SpiffeWorkloadAPI/FetchX509Bundles")
        with pytest.raises(grpc.RpcError):
            next(iter(stream(b"", timeout=5)))
    shown = status_json(f"127.0.0.1:{agent.status_port}")["workload_api"]
    assert shown["socket"] == str(socket)
    assert shown["refusals"] == {"missing_security_header": 1}
    assert shown["responses"]["FetchX509SVID"] >= 2
    text = meshca_status(f"127.0.0.1:{agent.status_port}").stdout
    assert f"SPIFFE Workload API on unix:{socket}" in text
    assert "refused: missing_security_header 1" in text
