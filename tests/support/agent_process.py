"""A real `meshca agent` process for tests, started through the CLI against a `CaProcess`.

Each agent gets its own directory (token file, SDS socket, output dir, log) under `workdir`,
a token minted by the CA for its namespace/service account, and a free loopback status port.
`start()` returns once `/healthz/ready` is 200 (it holds a certificate) and the SDS socket exists;
to start several at once, `launch()` each, then `wait_ready()` each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cryptography import x509

from certs import load_cert
from tests.support.ca_process import CaProcess
from tests.support.processes import (
    MeshcaProcess,
    child_env,
    free_port,
    http_status,
    http_text,
    wait_for,
)


class AgentProcess(MeshcaProcess):
    def __init__(
        self,
        workdir: Path,
        ca: CaProcess,
        service_account: str,
        *,
        namespace: str = "default",
        secret_ttl: str = "8s",
        extra_args: tuple[str, ...] = (),
        ca_root: Path | None = None,
    ) -> None:
        """`ca_root`: the root file the agent follows (and its taint notice beside it);
        default the CA's published one, `ca.root_cert_path`."""
        self.namespace = namespace
        self.service_account = service_account
        self.directory = workdir / service_account
        self.directory.mkdir(parents=True, exist_ok=True)
        self.token_path = self.directory / "token"
        self.sds_socket = self.directory / "sds.sock"
        self.output_dir = self.directory / "certs"
        self.status_port = free_port()
        self.token_path.write_text(ca.mint_token(namespace, service_account))
        args = [
            "agent",
            "--ca-addr", ca.addr,
            "--ca-root", str(ca_root or ca.root_cert_path),
            "--token-file", str(self.token_path),
            "--sds-socket", str(self.sds_socket),
            "--output-dir", str(self.output_dir),
            "--status-listen", f"127.0.0.1:{self.status_port}",
            "--namespace", namespace,
            "--service-account", service_account,
            "--secret-ttl", secret_ttl,
            *extra_args,
        ]  # fmt: skip
        super().__init__(args, self.directory / "agent.log")

    @property
    def identity(self) -> str:
        return f"spiffe://cluster.local/ns/{self.namespace}/sa/{self.service_account}"

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.status_port}"

    def start(self, timeout: float = 30) -> None:
        """Launches the child and waits until it is ready (stopping it if it never is)."""
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Starts the child without waiting for it."""
        super().start()

    def wait_ready(self, timeout: float = 30) -> None:
        """Waits for a launched agent to hold its first certificate."""
        try:
            wait_for(self._ready, timeout, f"agent {self.service_account} to hold a certificate")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if not self.running:
            raise RuntimeError(
                f"agent {self.service_account} exited with "
                f"{self.proc and self.proc.returncode}:\n{self.log()}"
            )
        return http_status(f"{self.status_url}/healthz/ready") == 200 and self.sds_socket.exists()

    def metrics(self) -> str:
        return http_text(f"{self.status_url}/metrics")

    def file_leaf(self) -> x509.Certificate | None:
        """The leaf in the output dir's current generation (None before the first)."""
        try:
            generation = Path(os.path.realpath(self.output_dir / "..data"))
            return load_cert((generation / "cert-chain.pem").read_bytes())
        except (FileNotFoundError, ValueError):
            return None  # not written yet, or that generation was just retired

    def wait_file_leaf(self, timeout: float = 10) -> x509.Certificate:
        """`file_leaf`, waiting for the first one (the files are written just after the agent
        reports ready)."""
        leaves: list[x509.Certificate] = []

        def written() -> bool:
            leaf = self.file_leaf()
            if leaf is not None:
                leaves.append(leaf)
            return leaf is not None

        wait_for(written, timeout, f"agent {self.service_account}'s certificate files")
        return leaves[-1]

    def file_serial(self) -> int | None:
        """Serial of the leaf in the output dir's current generation (None before the first)."""
        leaf = self.file_leaf()
        return None if leaf is None else int(leaf.serial_number)


def node_agent_args(
    workdir: Path,
    ca: CaProcess,
    node: str,
    kubeconfig: Path,
    status_listen: str,
    *extra: str,
    ca_root: Path | None = None,
    secret_ttl: str = "1h",
) -> list[str]:
    """`meshca agent --node-mode` for `node` against `ca`, with its token (`workdir/token`),
    SDS socket (`workdir/sds.sock`) and output directory (`workdir/certs`) in `workdir`; the
    command line every node-agent test runs, `extra` flags last."""
    return [
        "agent", "--node-mode", "--node-name", node,
        "--kubeconfig", str(kubeconfig),
        "--ca-addr", ca.addr, "--ca-root", str(ca_root or ca.root_cert_path),
        "--token-file", str(workdir / "token"), "--sds-socket", str(workdir / "sds.sock"),
        "--output-dir", str(workdir / "certs"), "--status-listen", status_listen,
        "--secret-ttl", secret_ttl,
        *extra,
    ]  # fmt: skip


def run_agent_to_exit(
    workdir: Path, sds_socket: Path, *, workload_api_socket: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`meshca agent` with no CA to reach, run until it exits: for a start that must be refused
    (a socket path it may not serve on) before the agent ever calls a CA."""
    args = [
        sys.executable, "-m", "meshca", "agent",
        "--ca-addr", "127.0.0.1:9", "--ca-root", str(workdir / "no-root.pem"),
        "--token-file", str(workdir / "no-token"), "--namespace", "a", "--service-account", "b",
        "--sds-socket", str(sds_socket), "--status-listen", "127.0.0.1:0",
    ]  # fmt: skip
    if workload_api_socket is not None:
        args += ["--workload-api-socket", str(workload_api_socket)]
    return subprocess.run(args, env=child_env(), capture_output=True, text=True, timeout=60)
