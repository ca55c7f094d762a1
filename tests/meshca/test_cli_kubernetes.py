"""`meshca ca` flags → `CaConfig.kube`: when Kubernetes mode is on, and what it is given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ca_server.config import CaConfig, ConfigError
from meshca.cli import build_parser


def _config(*args: str) -> CaConfig:
    parsed = build_parser("ca").parse_args(["ca", "--data-dir", "/tmp/d", *args])
    return CaConfig.from_args(parsed, os.environ)


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
    assert kube.istiod_tls and kube.istiod_namespace is None and kube.istiod_revisions == ()
    istiod = _config(
        "--kubeconfig",
        "/k",
        "--istiod-namespace",
        "istiod-ns",
        "--istiod-revisions",
        "canary,1-30",
        "--istiod-tls-lifetime",
        "2h",
    ).kube
    assert istiod is not None
    assert (istiod.istiod_namespace, istiod.istiod_revisions) == ("istiod-ns", ("canary", "1-30"))
    assert istiod.istiod_tls_lifetime.total_seconds() == 7200
    off = _config("--kubeconfig", "/k", "--no-istiod-tls").kube
    assert off is not None and not off.istiod_tls
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
        ("--kubeconfig", "/k", "--istiod-revisions", "Canary"),
        ("--kubeconfig", "/k", "--istiod-revisions", "ok,a.b"),
        ("--kubeconfig", "/k", "--istiod-revisions", "-x"),
        ("--kubeconfig", "/k", "--istiod-namespace", "Istio_System"),
        ("--kubeconfig", "/k", "--istiod-tls-lifetime", "1s"),
        ("--kubeconfig", "/k", "--istiod-tls-lifetime", "soon"),
    ],
)
def test_malformed_kubernetes_flags_are_refused(args: tuple[str, ...]):
    # argparse refuses a malformed number (SystemExit), the config build the rest (ConfigError).
    with pytest.raises((SystemExit, ConfigError)):
        _config(*args)


def test_environment_fills_in_what_flags_leave_open():
    parsed = build_parser("ca").parse_args(["ca", "--data-dir", "/d", "--kubeconfig", "/k"])
    environ = {
        "POD_NAMESPACE": "mesh-system",
        "CLUSTER_ID": "east",
        "CA_TRUSTED_NODE_ACCOUNTS": "kube-system/ztunnel",
        "POD_NAME": "meshca-0",
    }
    kube = CaConfig.from_args(parsed, environ).kube
    assert kube is not None
    assert (kube.namespace, kube.cluster_id, kube.instance_id) == (
        "mesh-system",
        "east",
        "meshca-0",
    )
    assert kube.trusted_node_accounts == (("kube-system", "ztunnel"),)
    flags = build_parser("ca").parse_args(
        ["ca", "--data-dir", "/d", "--kubeconfig", "/k", "--namespace", "ns", "--cluster-id", "c"]
    )
    kube = CaConfig.from_args(flags, environ).kube
    assert kube is not None and (kube.namespace, kube.cluster_id) == ("ns", "c")
