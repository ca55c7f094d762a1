"""The list+watch building block: resumes from its resourceVersion, re-lists on 410 Gone,
and keeps its secondary index in step with events."""

from __future__ import annotations

from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException

from meshca.informer import Informer
from meshca.pods import PodInfo, pod_info
from tests.support.kube_api import KubeApiServer
from tests.support.processes import wait_for


def test_relists_after_410_gone(kube_api: KubeApiServer, monkeypatch: pytest.MonkeyPatch):
    core = kubernetes.client.CoreV1Api(kube_api.api_client())
    restarts: list[str] = []
    informer: Informer[str] = Informer(
        "namespaces", core.list_namespace, lambda ns: ns.metadata.name, on_restart=restarts.append
    )
    watch_from = informer._watch_from
    resumed_from: list[str] = []

    def gone_once(resource_version: str) -> str:
        resumed_from.append(resource_version)
        if len(resumed_from) == 1:
            raise ApiException(status=410, reason="Gone")
        return watch_from(resource_version)

    monkeypatch.setattr(informer, "_watch_from", gone_once)
    informer.start()
    try:
        wait_for(lambda: len(resumed_from) == 2, 5, "the watch after the re-list")
        assert restarts == ["expired"]
        assert kube_api.count("list", "namespaces") == 2
        kube_api.create_namespace("late")
        wait_for(lambda: informer.get(("", "late")) == "late", 2, "the new namespace")
    finally:
        informer.stop()


def test_pod_index_by_node_follows_events(kube_api: KubeApiServer):
    core = kubernetes.client.CoreV1Api(kube_api.api_client())
    kube_api.create_pod("default", "a", node_name="n1")
    informer: Informer[PodInfo] = Informer(
        "pods",
        core.list_pod_for_all_namespaces,
        pod_info,
        indexers={"node": lambda pod: pod.node_name},
    )
    informer.start()
    try:
        assert informer.wait_synced(5)
        assert [p.name for p in informer.by_index("node", "n1")] == ["a"]
        kube_api.create_pod("default", "b", node_name="n1")
        wait_for(lambda: len(informer.by_index("node", "n1")) == 2, 2, "pod b on n1")
        kube_api.delete("pods", "a", namespace="default")
        wait_for(lambda: len(informer.by_index("node", "n1")) == 1, 2, "pod a gone")
        assert informer.by_index("node", "n2") == []
    finally:
        informer.stop()


def test_an_unexpected_exception_does_not_end_the_watch(kube_api: KubeApiServer):
    """A transform that chokes on one object once must not leave a cache that looks synced but
    never changes again (the node authorizer would decide on stale pods)."""
    core = kubernetes.client.CoreV1Api(kube_api.api_client())
    restarts: list[str] = []
    choked: list[str] = []

    def transform(ns: Any) -> str:
        if ns.metadata.name == "odd" and not choked:
            choked.append(ns.metadata.name)
            raise KeyError("a field this transform did not expect to be missing")
        return str(ns.metadata.name)

    informer: Informer[str] = Informer(
        "namespaces", core.list_namespace, transform, on_restart=restarts.append
    )
    informer.start()
    try:
        assert informer.wait_synced(5)
        kube_api.create_namespace("odd")
        wait_for(lambda: informer.get(("", "odd")) == "odd", 5, "the re-list after the error")
        assert choked == ["odd"] and restarts == ["error"]
        kube_api.create_namespace("later")
        wait_for(lambda: informer.get(("", "later")) == "later", 2, "events after the error")
    finally:
        informer.stop()
