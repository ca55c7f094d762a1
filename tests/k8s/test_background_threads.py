"""Kubernetes mode's background threads outlive an unexpected exception: a reconciler or an
elector that died silently would leave a leader publishing nothing, or a replica that never
takes over."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ca_server.kube.leader import LeaseElector
from ca_server.kube.root_publisher import CONFIGMAP_NAME, ROOT_KEY, RootConfigMapPublisher
from ca_server.metrics import CaMetrics
from meshca.clock import SystemClock
from tests.support.kube_api import KubeApiServer
from tests.support.processes import wait_for

ROOT = "-----BEGIN CERTIFICATE-----\nroot\n-----END CERTIFICATE-----\n"


def _raising_once(method: Any, failures: list[str]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append("raised")
            raise RuntimeError("an unexpected bug")
        return method(*args, **kwargs)

    return wrapper


def test_publisher_reconciles_after_an_unexpected_exception(
    kube_api: KubeApiServer, monkeypatch: pytest.MonkeyPatch
):
    kube_api.create_namespace("shop")
    publisher = RootConfigMapPublisher(kube_api.api_client(), lambda: True, CaMetrics())
    failures: list[str] = []
    monkeypatch.setattr(publisher, "reconcile", _raising_once(publisher.reconcile, failures))
    publisher.set_root(ROOT)
    publisher.start()
    try:
        wait_for(
            lambda: (
                (
                    kube_api.get("configmaps", CONFIGMAP_NAME, namespace="shop", missing_ok=True)
                    or {}
                )
                .get("data", {})
                .get(ROOT_KEY)
                == ROOT
            ),
            5,
            "the ConfigMap after the failed pass",
        )
        assert failures == ["raised"]
    finally:
        publisher.stop()


def test_elector_keeps_competing_after_an_unexpected_exception(
    kube_api: KubeApiServer, monkeypatch: pytest.MonkeyPatch
):
    elector = LeaseElector(
        kube_api.api_client(),
        "istio-system",
        "replica-a",
        lease_duration=timedelta(seconds=1),
        clock=SystemClock(),
    )
    failures: list[str] = []
    monkeypatch.setattr(
        elector, "try_acquire_or_renew", _raising_once(elector.try_acquire_or_renew, failures)
    )
    elector.start()
    try:
        wait_for(elector.is_leader, 5, "leadership after the failed round")
        assert failures == ["raised"]
    finally:
        elector.stop()
