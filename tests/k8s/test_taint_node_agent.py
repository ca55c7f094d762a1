"""Forced rotation reaches a node agent (issue #9): in Kubernetes mode (the fake API server, the
real `kubernetes` client), a real node agent serving several pod identities by impersonation
learns the taint from its one periodic report and re-signs every identity's leaf within
`--taint-resign-window`, each once; `prepare` and `activate` cost no CSR."""

from __future__ import annotations

import time
from pathlib import Path

from agent.propagation import leaf_authority
from certs import load_cert
from tests.k8s.conftest import CA_NAMESPACE, CaFactory, audit_lines, spiffe
from tests.k8s.test_node_agent_with_ca import NODE, _add_node_agent_pod
from tests.support.authority_cli import authority_rows, cluster_target, meshca_authority
from tests.support.kube_api import KubeApiServer
from tests.support.processes import MeshcaProcess, free_port, wait_for

WINDOW = 6.0
SLACK = 6.0


def _authority_of(path: Path) -> str | None:
    try:
        return leaf_authority(load_cert(path.read_bytes()))
    except (OSError, ValueError):
        return None


def test_node_agent_resigns_every_tainted_identity_within_the_window(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
) -> None:
    kube_api.create_namespace("shop")
    _add_node_agent_pod(kube_api)
    for account in ("cart", "orders", "payments"):
        kube_api.create_pod("shop", f"{account}-1", service_account=account, node_name=NODE)
    ca = kube_ca(
        "ca-0",
        "--no-root-configmaps",
        "--trusted-node-accounts",
        f"{CA_NAMESPACE}/node-agent",
        "--ca-reload-interval",
        "300ms",
    )
    target = cluster_target(kube_api.write_kubeconfig(tmp_path / "cli-kubeconfig"), CA_NAMESPACE)

    def authority(*args: str) -> None:
        result = meshca_authority(target, *args)
        assert result.returncode == 0, result.stderr

    workdir = tmp_path / "node"
    workdir.mkdir()
    (workdir / "token").write_text("node-agent-token")
    output = workdir / "certs"
    agent = MeshcaProcess(
        [
            "agent", "--node-mode", "--node-name", NODE,
            "--kubeconfig", str(kube_api.write_kubeconfig(workdir / "kubeconfig")),
            "--ca-addr", ca.addr, "--ca-root", str(ca.root_cert_path),
            "--token-file", str(workdir / "token"), "--sds-socket", str(workdir / "sds.sock"),
            "--output-dir", str(output), "--status-listen", f"127.0.0.1:{free_port()}",
            "--secret-ttl", "1h",
            "--report-interval", "1s", "--taint-resign-window", f"{WINDOW}s",
        ],
        workdir / "agent.log",
    )  # fmt: skip
    leaves = {
        spiffe("shop", a): output / "shop" / a / "cert-chain.pem"
        for a in ("cart", "orders", "payments")
    }
    leaves[spiffe(CA_NAMESPACE, "node-agent")] = (
        output / CA_NAMESPACE / "node-agent" / ("cert-chain.pem")
    )
    agent.start()
    try:
        (old_row,) = authority_rows(target, "show")
        old = old_row["id"]
        wait_for(
            lambda: all(_authority_of(p) == old for p in leaves.values()), 30, "every identity"
        )
        authority("prepare")
        authority("activate")
        new = next(r["id"] for r in authority_rows(target, "show") if r["state"] == "active")
        assert new != old
        time.sleep(1.0)  # the CA follows within a poll; the agent re-signs nothing for it
        assert all(_authority_of(p) == old for p in leaves.values())
        before = sum(1 for line in audit_lines(ca) if line.get("outcome") == "issued")
        assert before == len(leaves)

        authority("taint", old)
        tainted_at = time.time()
        wait_for(
            lambda: all(_authority_of(p) == new for p in leaves.values()),
            WINDOW + 1.2 + SLACK,
            "every identity re-signed under the new authority",
        )
        assert time.time() - tainted_at <= WINDOW + 1.2 + SLACK
        issued = [line["identity"] for line in audit_lines(ca) if line.get("outcome") == "issued"]
        assert sorted(issued[before:]) == sorted(leaves)  # each identity once
        assert agent.log().count("which the CA has tainted; re-signing in") == len(leaves)
    finally:
        agent.stop()
