"""Forced rotation reaches a node agent (issues #9, #17): in Kubernetes mode (the fake API
server, the real `kubernetes` client), a real node agent serving several pod identities by
impersonation learns the taint — from its one periodic report, or, with the default report
interval, from the taint notice in the root ConfigMap it mounts — and re-signs every
identity's leaf within `--taint-resign-window`, each once; `prepare` and `activate` cost no
CSR."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from pathlib import Path

from agent.propagation import leaf_authority
from ca_server.authority.slots import authority_id
from ca_server.kube.root_publisher import CONFIGMAP_NAME
from certs import load_cert, load_certs
from meshca.taint_notice import TAINT_NOTICE_NAME, decode_taint_notice, encode_taint_notice
from tests.k8s.test_node_agent_with_ca import NODE, _add_node_agent_pod
from tests.support.agent_process import node_agent_args
from tests.support.authority_cli import authority_rows, cluster_target, meshca_authority
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, audit_lines, spiffe
from tests.support.kubelet_volume import kubelet_project
from tests.support.processes import MeshcaProcess, free_port, wait_for

WINDOW = 6.0
SLACK = 6.0


def _authority_of(path: Path) -> str | None:
    try:
        return leaf_authority(load_cert(path.read_bytes()))
    except (OSError, ValueError):
        return None


def _authority(target: tuple[str, ...], *args: str) -> None:
    result = meshca_authority(target, *args)
    assert result.returncode == 0, result.stderr


def _activate_another(target: tuple[str, ...], leaves: dict[str, Path]) -> tuple[str, str]:
    """Waits until every leaf is the first authority's, then `prepare` and `activate` a new
    one; returns (old, new) IDs."""
    (old_row,) = authority_rows(target, "show")
    old = old_row["id"]
    wait_for(lambda: all(_authority_of(p) == old for p in leaves.values()), 30, "every identity")
    _authority(target, "prepare")
    _authority(target, "activate")
    new = next(r["id"] for r in authority_rows(target, "show") if r["state"] == "active")
    assert new != old
    return old, new


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

    workdir = tmp_path / "node"
    workdir.mkdir()
    (workdir / "token").write_text("node-agent-token")
    output = workdir / "certs"
    agent = MeshcaProcess(
        node_agent_args(
            workdir,
            ca,
            NODE,
            kube_api.write_kubeconfig(workdir / "kubeconfig"),
            f"127.0.0.1:{free_port()}",
            "--report-interval", "1s", "--taint-resign-window", f"{WINDOW}s",
        ),
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
        old, new = _activate_another(target, leaves)
        time.sleep(1.0)  # the CA follows within a poll; the agent re-signs nothing for it
        assert all(_authority_of(p) == old for p in leaves.values())
        before = sum(1 for line in audit_lines(ca) if line.get("outcome") == "issued")
        assert before == len(leaves)

        _authority(target, "taint", old)
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


class Kubelet:
    """What the kubelet does for a pod that mounts ConfigMap `istio-ca-root-cert`: projects
    every key into `mount` (`..data` swapped per version, `kubelet_project`) whenever the
    object changes. Polls every 0.2 s: a real kubelet takes up to its sync period (about a
    minute by default); this test is about the CA and the agent, not that delay."""

    def __init__(self, kube_api: KubeApiServer, namespace: str, mount: Path) -> None:
        self._api = kube_api
        self._namespace = namespace
        self.mount = mount
        self.versions: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet", daemon=True)

    def _data(self) -> dict[str, str] | None:
        cm = self._api.get("configmaps", CONFIGMAP_NAME, namespace=self._namespace, missing_ok=True)
        return dict(cm.get("data") or {}) if cm is not None else None

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            data = self._data()
            if data is not None and (not self.versions or data != self.versions[-1]):
                kubelet_project(self.mount, data)
                self.versions.append(data)

    def __enter__(self) -> Kubelet:
        wait_for(lambda: self._data() is not None, 10, f"{CONFIGMAP_NAME} published")
        self._thread.start()
        wait_for(lambda: (self.mount / "root-cert.pem").exists(), 5, "the first projection")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_taint_reaches_a_node_agent_through_the_root_configmap_mount(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
) -> None:
    """Kubernetes mode, the default report interval (2 min): the taint reaches the node agent
    through key `meshca-taints.json` of ConfigMap `istio-ca-root-cert`, which it reads beside
    the mounted `root-cert.pem`, long before its first report; every identity's leaf is
    re-signed within the window, each once. Every namespace's ConfigMap carries the same
    notice, and its `root-cert.pem` stays a plain PEM bundle."""
    kube_api.create_namespace("shop")
    _add_node_agent_pod(kube_api)
    for account in ("cart", "orders"):
        kube_api.create_pod("shop", f"{account}-1", service_account=account, node_name=NODE)
    ca = kube_ca(
        "ca-0",
        "--trusted-node-accounts", f"{CA_NAMESPACE}/node-agent",
        "--ca-reload-interval", "300ms",
    )  # fmt: skip
    target = cluster_target(kube_api.write_kubeconfig(tmp_path / "cli-kubeconfig"), CA_NAMESPACE)

    def notice_in(namespace: str) -> dict[str, datetime]:
        cm = kube_api.get("configmaps", CONFIGMAP_NAME, namespace=namespace)
        return decode_taint_notice(cm["data"][TAINT_NOTICE_NAME])

    workdir = tmp_path / "node"
    workdir.mkdir()
    (workdir / "token").write_text("node-agent-token")
    output = workdir / "certs"
    with Kubelet(kube_api, CA_NAMESPACE, workdir / "istio") as kubelet:
        assert notice_in(CA_NAMESPACE) == {}
        agent = MeshcaProcess(
            node_agent_args(
                workdir,
                ca,
                NODE,
                kube_api.write_kubeconfig(workdir / "kubeconfig"),
                f"127.0.0.1:{free_port()}",
                "--taint-resign-window", f"{WINDOW}s",
                ca_root=kubelet.mount / "root-cert.pem",
            ),
            workdir / "agent.log",
        )  # fmt: skip
        leaves = {
            spiffe(ns, a): output / ns / a / "cert-chain.pem"
            for ns, a in (("shop", "cart"), ("shop", "orders"), (CA_NAMESPACE, "node-agent"))
        }
        agent.start()
        try:
            old, new = _activate_another(target, leaves)
            wait_for(lambda: len(kubelet.versions) >= 2, 10, "the new bundle projected")
            before = sum(1 for line in audit_lines(ca) if line.get("outcome") == "issued")
            assert before == len(leaves)

            tainted_at = time.time()  # before the command: its run time counts too
            _authority(target, "taint", old)
            wait_for(
                lambda: all(_authority_of(p) == new for p in leaves.values()),
                WINDOW + SLACK,
                "every identity re-signed under the new authority",
            )
            replaced_within = time.time() - tainted_at
            issued = [
                line["identity"] for line in audit_lines(ca) if line.get("outcome") == "issued"
            ]
            assert sorted(issued[before:]) == sorted(leaves)  # each identity once
            log = agent.log()
            assert "(learnt from the taint-notice)" in log
            assert "learnt from the report" not in log  # no report is due for minutes
            assert log.count("which the CA has tainted; re-signing in") == len(leaves)
            print(f"\nnode agent, Kubernetes mode: every leaf replaced {replaced_within:.1f} s "
                  f"after the taint (window {WINDOW:g} s, report interval 2 min)")  # fmt: skip
        finally:
            agent.stop()

    # What the kubelet projected, and every namespace's copy: the bundle stays PEM (Envoy and
    # pilot-agent read it as is), the notice beside it names the taint.
    (tainted,) = notice_in("shop").items()
    assert tainted[0] == old and notice_in(CA_NAMESPACE) == notice_in("shop")
    assert all(
        {authority_id(c) for c in load_certs(v["root-cert.pem"].encode())} <= {old, new}
        for v in kubelet.versions
    )
    assert kubelet.versions[-1][TAINT_NOTICE_NAME] == encode_taint_notice({old: tainted[1]})
    # A namespace's copy edited to un-taint (or break) the notice is put back, as the bundle is.
    edited = kube_api.get("configmaps", CONFIGMAP_NAME, namespace="shop")
    edited["data"][TAINT_NOTICE_NAME] = encode_taint_notice({})
    kube_api.update("configmaps", edited)
    wait_for(lambda: notice_in("shop") == dict([tainted]), 5, "the edited notice restored")
