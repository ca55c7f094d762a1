"""The Kubernetes API server misbehaving (injected with `tests.support.kube_api.faults`): slow,
500/429 on list, 410 and cut watches, a restart mid-watch. The informer the CA (and the node
agent) build on must end each episode with a cache equal to the server's objects, and keep
following changes — both the model-object `Informer` and the CA's raw-JSON, paginated
`PagedInformer` (every test runs with each)."""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes.client
import pytest

from meshca.informer import Informer
from meshca.paged_informer import PagedInformer
from tests.support.kube_api import Fault, KubeApiServer
from tests.support.processes import wait_for


@pytest.fixture
def kube_api(starts_processes: None) -> Iterator[KubeApiServer]:
    with KubeApiServer() as server:
        yield server


class Following:
    """A namespace informer plus the causes of its restarts."""

    def __init__(self, kube_api: KubeApiServer, paged: bool) -> None:
        core = kubernetes.client.CoreV1Api(kube_api.api_client())
        self.restarts: list[str] = []
        self.informer: Informer[str]
        if paged:
            self.informer = PagedInformer(
                "namespaces",
                core.list_namespace,
                lambda ns: str(ns["metadata"]["name"]),
                on_restart=self.restarts.append,
            )
        else:
            self.informer = Informer(
                "namespaces",
                core.list_namespace,
                lambda ns: str(ns.metadata.name),
                on_restart=self.restarts.append,
            )

    def names(self) -> set[str]:
        return {key[1] for key in self.informer.items()}

    def converges_to(self, kube_api: KubeApiServer, timeout: float = 8) -> None:
        expected = {ns["metadata"]["name"] for ns in kube_api.list("namespaces")}
        wait_for(lambda: self.names() == expected, timeout, f"namespaces {sorted(expected)}")


@pytest.fixture(params=["informer", "paged"])
def following(kube_api: KubeApiServer, request: pytest.FixtureRequest) -> Iterator[Following]:
    watcher = Following(kube_api, paged=request.param == "paged")
    yield watcher
    watcher.informer.stop()


@pytest.mark.parametrize("status", [500, 429, 503])
def test_failing_lists_are_retried_until_the_cache_is_right(
    kube_api: KubeApiServer, following: Following, status: int
) -> None:
    kube_api.faults.add(Fault("list", "namespaces", status=status, times=2))
    following.informer.start()
    assert following.informer.wait_synced(10)
    # Two refused lists, then one that worked; retried by the informer (a restart each) or,
    # for 429 with Retry-After, possibly by the HTTP client underneath.
    assert kube_api.count("list", "namespaces") == 3
    if status != 429:  # a 429 with Retry-After may be retried by urllib3, below the informer
        assert following.restarts == ["error", "error"]
    following.converges_to(kube_api)
    kube_api.create_namespace("after-errors")
    following.converges_to(kube_api)


def test_a_slow_list_delays_sync_but_does_not_break_it(
    kube_api: KubeApiServer, following: Following
) -> None:
    kube_api.faults.add(Fault("list", "namespaces", delay=1.0, times=1))
    following.informer.start()
    assert not following.informer.wait_synced(0.5)
    assert following.informer.wait_synced(5)
    following.converges_to(kube_api)


def test_a_410_on_the_watch_relists(kube_api: KubeApiServer, following: Following) -> None:
    kube_api.faults.add(Fault("watch", "namespaces", status=410, times=1))
    following.informer.start()
    wait_for(lambda: "expired" in following.restarts, 5, "a re-list after 410")
    kube_api.create_namespace("after-410")
    following.converges_to(kube_api)
    assert kube_api.count("list", "namespaces") == 2


def test_a_watch_cut_after_one_event_resumes_without_relisting(
    kube_api: KubeApiServer, following: Following
) -> None:
    # Armed before the informer starts, so its first three watches each end after one event
    # (a clean end of stream, as a proxy cutting long requests gives). Cutting the open watch
    # with a server restart instead was racy: a restart may end the stream mid-chunk, which
    # is an error the informer rightly answers with a re-list.
    cut = kube_api.faults.add(Fault("watch", "namespaces", drop_watch_after=1, times=3))
    following.informer.start()
    assert following.informer.wait_synced(5)
    for name in ("cut-a", "cut-b", "cut-c", "cut-d"):
        kube_api.create_namespace(name)
    following.converges_to(kube_api, timeout=10)
    # Three cut watches, each resumed from the last event it delivered, then a fourth that
    # stays open: one list in all, and no restart of the informer.
    wait_for(lambda: kube_api.count("watch", "namespaces") >= 4, 5, "the fourth watch")
    assert cut.hits == 3
    assert kube_api.count("list", "namespaces") == 1
    assert following.restarts == []


def test_an_api_server_restart_mid_watch_is_survived(
    kube_api: KubeApiServer, following: Following
) -> None:
    following.informer.start()
    assert following.informer.wait_synced(5)
    kube_api.create_namespace("before-restart")
    following.converges_to(kube_api)
    kube_api.restart(downtime=0.5)
    kube_api.create_namespace("after-restart")
    following.converges_to(kube_api, timeout=10)
    kube_api.delete("namespaces", "before-restart")
    following.converges_to(kube_api, timeout=10)
