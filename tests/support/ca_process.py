"""A real `meshca ca` process for tests, plus the development token issuer it trusts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.processes import (
    MeshcaProcess,
    child_env,
    free_port,
    http_status,
    http_text,
    wait_for,
)

# Which gRPC server the CAs under test run (`--rpc-server`): the wire tests run on both paths,
# `MESHCA_TEST_RPC_SERVER=aio` (grpc.aio's server) and `completion-queue` (the default, auto).
RPC_SERVER_ENV = "MESHCA_TEST_RPC_SERVER"


def rpc_server_args(extra_args: tuple[str, ...] | list[str] = ()) -> list[str]:
    choice = os.environ.get(RPC_SERVER_ENV)
    if not choice or "--rpc-server" in extra_args:
        return []
    return ["--rpc-server", choice]


class CaProcess(MeshcaProcess):
    """`meshca ca --data-dir D` on free loopback ports; `start()` returns once `/ready` is 200.

    One worker unless `extra_args` say `--workers`: most tests are about what one CA process
    does (and a reload reaches all workers only within a poll interval, like replicas);
    `tests/ca_server/serving/test_workers.py` covers the supervisor and its workers.
    """

    def __init__(self, data_dir: Path, *extra_args: str, env: dict[str, str] | None = None):
        self.data_dir = data_dir
        self.port = free_port()
        self.monitoring_port = free_port()
        # `/debug/ca` (what `meshca status` reads of a CA) is only on the debug address.
        self.debug_port = free_port()
        self.extra_args = list(extra_args)
        args = [
            "ca",
            "--data-dir",
            str(data_dir),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--monitoring-listen",
            f"127.0.0.1:{self.monitoring_port}",
            "--debug-listen",
            f"127.0.0.1:{self.debug_port}",
            "--min-workload-cert-ttl",
            "1s",
            *([] if "--workers" in extra_args else ["--workers", "1"]),
            *rpc_server_args(extra_args),
            *extra_args,
        ]
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(args, data_dir.parent / f"{data_dir.name}-ca.log", env)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def root_cert_path(self) -> Path:
        return self.data_dir / "root-cert.pem"

    @property
    def monitoring_url(self) -> str:
        return f"http://127.0.0.1:{self.monitoring_port}"

    @property
    def debug_address(self) -> str:
        """`--debug-listen`: `/debug/ca` and `/metrics`, what `meshca status` of a CA reads."""
        return f"127.0.0.1:{self.debug_port}"

    @property
    def debug_url(self) -> str:
        return f"http://{self.debug_address}"

    def start(self, timeout: float = 30) -> None:
        super().start()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Starts the process without waiting (to start several at the same instant)."""
        super().start()

    def wait_ready(self, timeout: float = 30) -> None:
        try:
            wait_for(self._ready, timeout, "the CA's /ready")
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"CA did not become ready; its log:\n{self.log()}") from None

    def _ready(self) -> bool:
        if not self.running:
            raise RuntimeError(
                f"CA exited with {self.proc and self.proc.returncode}:\n{self.log()}"
            )
        return http_status(f"{self.monitoring_url}/ready") == 200

    def metrics(self) -> str:
        return http_text(f"{self.monitoring_url}/metrics")

    def mint_token(
        self,
        namespace: str,
        service_account: str,
        *,
        ttl: str = "1h",
        audience: str = "istio-ca",
        pod_name: str | None = None,
    ) -> str:
        """A development token (shaped like a Kubernetes projected SA token) the CA trusts,
        bound to a pod (`pod_name`, default `<account>-dev`) with a fresh uid: each call is a
        new pod as far as agent reports go."""
        return mint_token(
            self.data_dir, namespace, service_account, ttl=ttl, audience=audience, pod_name=pod_name
        )


def mint_token(
    data_dir: Path,
    namespace: str,
    service_account: str,
    *,
    ttl: str = "1h",
    audience: str = "istio-ca",
    pod_name: str | None = None,
) -> str:
    pod = ["--pod-name", pod_name] if pod_name is not None else []
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshca",
            "token",
            "--data-dir",
            str(data_dir),
            "--namespace",
            namespace,
            "--service-account",
            service_account,
            "--ttl",
            ttl,
            "--audience",
            audience,
            *pod,
        ],
        env=child_env(),
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip()
