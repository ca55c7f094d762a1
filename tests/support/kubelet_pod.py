"""A pod whose identity the kubelet writes (Kubernetes Pod Certificates), for process tests.

`KubeletPod` is the pod's projected volume (`podCertificate` with `credentialBundlePath` and a
`clusterTrustBundle` projection, both in one volume: one `..data` swap updates both, as
`tests/support/kubelet_volume.kubelet_project` does) and a real `meshca agent` process in
file-mounted mode reading it (`--file-mounted-certs --credential-bundle`): no CA, no token.
`kubelet_writes()` plays the kubelet's refresh; `start()` returns once the agent is ready (it
serves a valid certificate) and its SDS socket exists; always `stop()` it.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.kubelet_volume import kubelet_project
from tests.support.metrics import sample_value
from tests.support.processes import MeshcaProcess, free_port, http_status, http_text, wait_for

CREDENTIAL_BUNDLE = "credential-bundle.pem"  # the pod spec's credentialBundlePath
TRUST_BUNDLE = "root-cert.pem"  # the clusterTrustBundle projection's path
RELOAD_FAILURES = "meshca_agent_file_reload_failures_total"
EXPIRY = "meshca_agent_cert_expiry_timestamp_seconds"


class KubeletPod(MeshcaProcess):
    def __init__(self, workdir: Path, name: str, *, workload_api: bool = False) -> None:
        self.name = name
        self.directory = workdir / name
        self.volume = self.directory / "certs"
        self.sds_socket = self.directory / "sds.sock"
        self.workload_api_socket = self.directory / "wapi.sock" if workload_api else None
        self.status_port = free_port()
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            "agent", "--file-mounted-certs",
            "--file-mounted-dir", str(self.volume),
            "--credential-bundle", str(self.volume / CREDENTIAL_BUNDLE),
            "--sds-socket", str(self.sds_socket),
            "--status-listen", f"127.0.0.1:{self.status_port}",
        ]  # fmt: skip
        if self.workload_api_socket is not None:
            args += ["--workload-api-socket", f"unix:{self.workload_api_socket}"]
        super().__init__(args, self.directory / "agent.log")

    def kubelet_writes(self, credential_bundle: str, trust_bundle: str) -> None:
        """The kubelet's refresh of the projected volume: both files in one new generation."""
        kubelet_project(
            self.volume, {CREDENTIAL_BUNDLE: credential_bundle, TRUST_BUNDLE: trust_bundle}
        )

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.status_port}"

    def start(self, timeout: float = 30) -> None:
        super().start()
        try:
            wait_for(self._ready, timeout, f"pod {self.name}'s agent to serve the bundle")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if not self.running:
            raise RuntimeError(f"agent of pod {self.name} exited:\n{self.log()}")
        return http_status(f"{self.status_url}/healthz/ready") == 200 and self.sds_socket.exists()

    def reload_failures(self) -> float:
        """`file_reload_failures` for `default`: bundles the agent refused."""
        metrics = http_text(f"{self.status_url}/metrics")
        return sample_value(metrics, RELOAD_FAILURES, {"resource_name": "default"})

    def served_expiry(self) -> float:
        """The expiry the agent reports for `default` (0.0 before it serves one)."""
        metrics = http_text(f"{self.status_url}/metrics")
        return sample_value(metrics, EXPIRY, {"resource_name": "default"})
