"""`meshca ca` flags → `CaConfig.kube`: when Kubernetes mode is on, and what it is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from ca_server.config import CaConfig
from meshca.cli import build_parser, ca_config_from_args


def _config(*args: str) -> CaConfig:
    return ca_config_from_args(build_parser().parse_args(["ca", "--data-dir", "/tmp/d", *args]))


def test_local_mode_without_kubeconfig(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = _config()
    assert config.kube is None
    assert config.trust_dev_issuer


def test_kubeconfig_turns_kubernetes_mode_on(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CA_TRUSTED_NODE_ACCOUNTS", "istio-system/ztunnel")
    config = _config(
        "--kubeconfig",
        "/k/config",
        "--remote-kubeconfig",
        "west=/k/west",
        "--audience",
        "mesh",
        "--instance-id",
        "ca-a",
    )
    kube = config.kube
    assert kube is not None
    assert kube.kubeconfig == Path("/k/config")
    assert kube.remote_kubeconfigs == (("west", Path("/k/west")),)
    assert kube.trusted_node_accounts == (("istio-system", "ztunnel"),)
    assert kube.audiences == ("mesh",)
    assert kube.namespace == "istio-system" and kube.cluster_id == "Kubernetes"
    assert kube.token_review and kube.publish_root
    assert not config.trust_dev_issuer, "the dev issuer is never trusted by default in a cluster"
    assert _config("--kubeconfig", "/k", "--no-kubernetes").kube is None


@pytest.mark.parametrize(
    "args",
    [
        ("--kubeconfig", "/k", "--remote-kubeconfig", "west"),
        ("--kubeconfig", "/k", "--trusted-node-accounts", "ztunnel"),
        ("--kubeconfig", "/k", "--kube-qps", "0"),
        ("--kubeconfig", "/k", "--kube-burst", "-1"),
        ("--kubeconfig", "/k", "--kube-qps", "fast"),
    ],
)
def test_malformed_kubernetes_flags_are_refused(args: tuple[str, ...]):
    with pytest.raises(SystemExit):
        _config(*args)
