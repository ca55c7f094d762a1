"""A `--workers N` worker's lookups in its supervisor's caches (`ca_server.kube.cache_service`
and `cache_client`) over a real Unix socket: the same answers as the cache itself, one batch
for a fleet, and a server that survives what a confused client sends and never takes over a
live socket."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ca_server.config import KubeConfig
from ca_server.errors import DependencyUnavailableError
from ca_server.kube.cache_client import RemoteKubeCaches
from ca_server.kube.cache_service import MAX_BATCH, MAX_REQUEST_BYTES, KubeCacheServer
from ca_server.kube.caches import LocalKubeCaches
from tests.support.kube_api import KubeApiServer
from tests.support.processes import wait_for


@pytest.fixture
def served(kube_api: KubeApiServer, tmp_path: Path) -> Iterator[tuple[LocalKubeCaches, Path]]:
    kube_api.create_namespace("shop")
    kube_api.create_service_account("shop", "cart")
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="n1", uid="u1")
    kube_api.create_pod("shop", "done-1", service_account="cart", node_name="n1", phase="Failed")
    caches = LocalKubeCaches(kube_api.api_client(), True, True, KubeConfig())
    path = tmp_path / "caches.sock"
    server = KubeCacheServer(caches, path)
    server.start()
    caches.start()
    try:
        assert caches.pods is not None and caches.pods.wait_synced(5)
        assert caches.accounts is not None and caches.accounts.wait_synced(5)
        yield caches, path
    finally:
        server.stop()
        caches.stop()


def _ask(path: Path, *lines: bytes) -> list[object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        reader = sock.makefile("rb")
        answers = []
        for line in lines:
            sock.sendall(line)
            answers.append(json.loads(reader.readline() or b"null"))
        return answers


def test_a_worker_sees_what_the_supervisor_holds(served: tuple[LocalKubeCaches, Path]):
    caches, path = served
    remote = RemoteKubeCaches(path)
    remote.start(True, True)
    try:
        wait_for(lambda: remote.pods.synced and remote.accounts.synced, 5, "the state")
        assert remote.pods.get("shop", "cart-1") == caches.pods.get("shop", "cart-1")  # type: ignore[union-attr]
        assert remote.pods.get("shop", "nope") is None
        assert remote.pods.runs_on_node("n1", "shop", "cart")
        assert not remote.pods.runs_on_node("n2", "shop", "cart")
        assert remote.accounts.uid("shop", "cart") == caches.accounts.uid("shop", "cart")  # type: ignore[union-attr]
        assert remote.accounts.uid("shop", "gone") is None
        keys = [("shop", "cart-1"), ("shop", "done-1"), ("x", "y")] * (MAX_BATCH // 2)
        found = remote.pods.get_many(keys)  # more than one batch
        assert [p.name if p else None for p in found[:3]] == ["cart-1", "done-1", None]
        assert len(found) == len(keys)
        assert asyncio.run(remote.pods.fetch("shop", "cart-1")) is not None
        assert remote.pods.progress().objects == 2
        assert remote.pods.changes >= 1
    finally:
        remote.stop()


def test_bad_requests_get_an_error_and_the_connection_and_server_go_on(
    served: tuple[LocalKubeCaches, Path],
):
    _, path = served
    answers = _ask(
        path,
        b"not json\n",
        b'{"op": "pod"}\n',
        b'["pod", 1, 2]\n',
        b'["drop-tables"]\n',
        b'["pods", ' + json.dumps([["a", "b"]] * (MAX_BATCH + 1)).encode() + b"]\n",
        b'["pod", "shop", "cart-1"]\n',
    )
    assert all(isinstance(a, dict) and "error" in a for a in answers[:5]), answers
    assert answers[5][1][0] == "u1"  # type: ignore[index]
    # A request longer than any valid one closes that connection only.
    assert "error" in _ask(path, b"[" + b" " * MAX_REQUEST_BYTES + b"]\n")[0]  # type: ignore[operator]
    assert _ask(path, b'["state"]\n')[0][0][0] is True  # type: ignore[index]


def test_a_second_server_refuses_a_live_socket(served: tuple[LocalKubeCaches, Path]):
    caches, path = served
    with pytest.raises(OSError):
        KubeCacheServer(caches, path)
    assert _ask(path, b'["state"]\n')[0][0][0] is True  # type: ignore[index]


def test_a_worker_whose_supervisor_is_gone_gets_unavailable(tmp_path: Path):
    remote = RemoteKubeCaches(tmp_path / "nobody.sock")
    with pytest.raises(DependencyUnavailableError, match="supervisor"):
        remote.pods.get("shop", "cart-1")
    assert not remote.pods.synced
