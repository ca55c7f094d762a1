"""The fake kube-apiserver, exercised only through the official ``kubernetes`` client.

If these pass, meshca code written against the real client can be tested against the fake
without adaptation: status codes, Status reasons, watch framing and resume all match.
"""

# The client's generated models type every field as Optional and its methods as taking model
# classes, but at runtime it accepts plain dicts; these tests deliberately use both forms.
# mypy: disable-error-code="union-attr,arg-type,index,misc"

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.support.kube_api import POD_NAME_KEY, POD_UID_KEY, KubeApiServer

pytestmark = pytest.mark.process  # every test starts the fake Kubernetes API server

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(starts_processes: None) -> Iterator[KubeApiServer]:
    with KubeApiServer() as srv:
        yield srv


@pytest.fixture
def api_client(server: KubeApiServer) -> Iterator[client.ApiClient]:
    with client.ApiClient(client.Configuration(host=server.url)) as api:
        yield api


@pytest.fixture
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@contextmanager
def running(**kwargs: Any) -> Iterator[tuple[KubeApiServer, client.CoreV1Api]]:
    """A server with non-default options, plus a CoreV1Api pointed at it."""
    with (
        KubeApiServer(**kwargs) as srv,
        client.ApiClient(client.Configuration(host=srv.url)) as api,
    ):
        yield srv, client.CoreV1Api(api)


def reason_of(exc: ApiException) -> str:
    return str(json.loads(exc.body)["reason"])


def secret(name: str, labels: dict[str, str] | None = None, **data: str) -> client.V1Secret:
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=name, labels=labels), string_data=data or None
    )


def collect(
    stream: Iterator[dict[str, Any]], w: watch.Watch, count: int
) -> list[tuple[str, str, str]]:
    """Take ``count`` events as (type, name, resourceVersion), then stop the watch."""
    events = []
    for event in stream:
        obj = event["raw_object"]
        events.append((event["type"], obj["metadata"]["name"], obj["metadata"]["resourceVersion"]))
        if len(events) == count:
            w.stop()
    return events


# -- CRUD ------------------------------------------------------------------------------------


def test_secret_crud_round_trip(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_secret("default", secret("s1", {"app": "a"}, key="value"))
    assert created.data == {"key": base64.b64encode(b"value").decode()}
    assert created.type == "Opaque"
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert created.metadata.namespace == "default"

    got = core.read_namespaced_secret("s1", "default")
    assert got.metadata.resource_version == created.metadata.resource_version

    got.string_data = {"other": "x"}
    replaced = core.replace_namespaced_secret("s1", "default", got)
    assert set(replaced.data) == {"key", "other"}
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)
    assert replaced.metadata.uid == created.metadata.uid

    patched = core.patch_namespaced_secret(
        "s1", "default", {"metadata": {"labels": {"extra": "1", "app": None}}}
    )
    assert patched.metadata.labels == {"extra": "1"}
    json_patched = core.patch_namespaced_secret(
        "s1", "default", [{"op": "remove", "path": "/data/other"}]
    )
    assert set(json_patched.data) == {"key"}

    core.delete_namespaced_secret("s1", "default")
    with pytest.raises(ApiException) as info:
        core.read_namespaced_secret("s1", "default")
    assert info.value.status == 404
    assert reason_of(info.value) == "NotFound"


def test_configmap_crud_and_generate_name(core: client.CoreV1Api) -> None:
    cm = core.create_namespaced_config_map(
        "default", {"metadata": {"generateName": "cfg-"}, "data": {"a": "1"}}
    )
    name = cm.metadata.name
    assert name.startswith("cfg-") and len(name) == len("cfg-") + 5
    cm.data["b"] = "2"
    updated = core.replace_namespaced_config_map(name, "default", cm)
    assert updated.data == {"a": "1", "b": "2"}
    patched = core.patch_namespaced_config_map(name, "default", {"data": {"a": None}})
    assert patched.data == {"b": "2"}
    assert [c.metadata.name for c in core.list_namespaced_config_map("default").items] == [name]
    core.delete_namespaced_config_map(name, "default")
    assert core.list_namespaced_config_map("default").items == []


def test_namespace_crud_and_cascading_delete(server: KubeApiServer, core: client.CoreV1Api) -> None:
    ns = core.create_namespace({"metadata": {"name": "team-a", "labels": {"env": "dev"}}})
    assert ns.status.phase == "Active"
    assert ns.metadata.labels["kubernetes.io/metadata.name"] == "team-a"
    assert "team-a" in {n.metadata.name for n in core.list_namespace().items}
    core.create_namespaced_secret("team-a", secret("s", key="v"))
    core.create_namespaced_config_map("team-a", {"metadata": {"name": "c"}})
    server.create_pod("team-a", "p")

    core.delete_namespace("team-a")
    with pytest.raises(ApiException) as info:
        core.read_namespace("team-a")
    assert info.value.status == 404
    assert server.list("secrets", namespace="team-a") == []
    assert server.list("pods", namespace="team-a") == []
    assert server.list("configmaps", namespace="team-a") == []
    # Creating into a namespace that does not exist fails like the real server.
    with pytest.raises(ApiException) as info:
        core.create_namespaced_secret("team-a", secret("s2"))
    assert info.value.status == 404
    assert 'namespaces "team-a" not found' in json.loads(info.value.body)["message"]


def test_pod_crud_and_status_subresource(core: client.CoreV1Api) -> None:
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="web", labels={"app": "web"}),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="c", image="img")], node_name="node-1"
        ),
    )
    created = core.create_namespaced_pod("default", pod)
    assert created.status.phase == "Pending"
    running = core.patch_namespaced_pod_status(
        "web", "default", {"status": {"phase": "Running", "podIP": "10.0.0.7"}}
    )
    assert running.status.phase == "Running"
    # Updating the main resource cannot change status.
    running.status.phase = "Failed"
    running.metadata.labels["v"] = "2"
    replaced = core.replace_namespaced_pod("web", "default", running)
    assert replaced.status.phase == "Running"
    assert replaced.metadata.labels == {"app": "web", "v": "2"}
    deleted = core.delete_namespaced_pod("web", "default")
    assert deleted.metadata.name == "web"  # pods return the deleted object
    assert core.list_namespaced_pod("default").items == []


def test_lease_crud_and_optimistic_concurrency(api_client: client.ApiClient) -> None:
    coord = client.CoordinationV1Api(api_client)
    now = datetime.now(UTC)
    lease = coord.create_namespaced_lease(
        "kube-system",
        client.V1Lease(
            metadata=client.V1ObjectMeta(name="meshca-leader"),
            spec=client.V1LeaseSpec(
                holder_identity="a", lease_duration_seconds=15, acquire_time=now, renew_time=now
            ),
        ),
    )
    assert lease.spec.holder_identity == "a"
    assert lease.spec.renew_time is not None
    stale = coord.read_namespaced_lease("meshca-leader", "kube-system")

    lease.spec.holder_identity = "b"
    lease.spec.lease_transitions = 1
    won = coord.replace_namespaced_lease("meshca-leader", "kube-system", lease)
    assert won.spec.holder_identity == "b"

    stale.spec.holder_identity = "c"
    with pytest.raises(ApiException) as info:
        coord.replace_namespaced_lease("meshca-leader", "kube-system", stale)
    assert info.value.status == 409
    assert reason_of(info.value) == "Conflict"
    assert [x.metadata.name for x in coord.list_namespaced_lease("kube-system").items] == [
        "meshca-leader"
    ]
    coord.delete_namespaced_lease("meshca-leader", "kube-system")
    with pytest.raises(ApiException) as info:
        coord.read_namespaced_lease("meshca-leader", "kube-system")
    assert info.value.status == 404


# -- errors and concurrency ------------------------------------------------------------------


def test_duplicate_create_is_already_exists(core: client.CoreV1Api) -> None:
    core.create_namespaced_secret("default", secret("dup"))
    with pytest.raises(ApiException) as info:
        core.create_namespaced_secret("default", secret("dup"))
    assert info.value.status == 409
    body = json.loads(info.value.body)
    assert body["kind"] == "Status"
    assert body["reason"] == "AlreadyExists"
    assert body["details"] == {"name": "dup", "kind": "secrets"}


def test_stale_update_conflicts_and_unconditional_update_wins(core: client.CoreV1Api) -> None:
    first = core.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
    core.patch_namespaced_config_map("c", "default", {"data": {"k": "1"}})
    first.data = {"k": "stale"}
    with pytest.raises(ApiException) as info:
        core.replace_namespaced_config_map("c", "default", first)
    assert info.value.status == 409
    assert reason_of(info.value) == "Conflict"
    # A patch carrying a stale resourceVersion is also a precondition failure.
    with pytest.raises(ApiException) as info:
        core.patch_namespaced_config_map(
            "c", "default", {"metadata": {"resourceVersion": first.metadata.resource_version}}
        )
    assert info.value.status == 409

    first.metadata.resource_version = None
    forced = core.replace_namespaced_config_map("c", "default", first)
    assert forced.data == {"k": "stale"}


def test_delete_preconditions(core: client.CoreV1Api) -> None:
    cm = core.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
    core.patch_namespaced_config_map("c", "default", {"data": {"k": "v"}})
    stale = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(resource_version=cm.metadata.resource_version)
    )
    with pytest.raises(ApiException) as info:
        core.delete_namespaced_config_map("c", "default", body=stale)
    assert info.value.status == 409
    by_uid = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=cm.metadata.uid))
    status = core.delete_namespaced_config_map("c", "default", body=by_uid)
    assert status["status"] == "Success"


def test_not_found_and_bad_requests(core: client.CoreV1Api) -> None:
    for call in (
        lambda: core.read_namespaced_config_map("nope", "default"),
        lambda: core.delete_namespaced_secret("nope", "default"),
        lambda: core.patch_namespaced_pod("nope", "default", {"metadata": {}}),
        lambda: core.read_namespace("nope"),
    ):
        with pytest.raises(ApiException) as info:
            call()
        assert info.value.status == 404
        assert reason_of(info.value) == "NotFound"
    with pytest.raises(ApiException) as info:
        core.create_namespaced_secret("default", {"metadata": {"name": "x"}, "data": {"k": "!!"}})
    assert info.value.status == 400
    with pytest.raises(ApiException) as info:
        core.create_namespaced_secret("default", {"metadata": {}})
    assert info.value.status == 422


def race_create(url: str, name: str, racers: int) -> list[int]:
    """``racers`` threads, each with its own ApiClient (connection pool), create one Secret."""
    barrier = threading.Barrier(racers)
    outcomes: list[int] = []
    lock = threading.Lock()

    def race() -> None:
        with client.ApiClient(client.Configuration(host=url)) as api:
            core = client.CoreV1Api(api)
            barrier.wait()
            try:
                core.create_namespaced_secret("default", secret(name, key="v"))
                code = 201
            except ApiException as exc:
                code = exc.status
        with lock:
            outcomes.append(code)

    threads = [threading.Thread(target=race) for _ in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return sorted(outcomes)


def test_racing_creates_have_exactly_one_winner(server: KubeApiServer) -> None:
    racers = 4
    for round_ in range(5):
        assert race_create(server.url, f"race-{round_}", racers) == [201] + [409] * (racers - 1)
    assert server.count("create", "secrets") == 5 * racers


# -- selectors and listing -------------------------------------------------------------------


def test_label_selectors(server: KubeApiServer, core: client.CoreV1Api) -> None:
    server.create_configmap("default", "a", labels={"app": "x", "tier": "web"})
    server.create_configmap("default", "b", labels={"app": "y"})
    server.create_configmap("default", "c")

    def names(selector: str) -> list[str]:
        items = core.list_namespaced_config_map("default", label_selector=selector).items
        return [i.metadata.name for i in items]

    assert names("app=x") == ["a"]
    assert names("app==x") == ["a"]
    assert names("app!=x") == ["b", "c"]
    assert names("app") == ["a", "b"]
    assert names("!app") == ["c"]
    assert names("app in (x, y),tier") == ["a"]
    assert names("app notin (x)") == ["b", "c"]
    assert names("app=x,tier=db") == []
    with pytest.raises(ApiException) as info:
        names("app=(")
    assert info.value.status == 400


def test_field_selectors_and_cluster_wide_lists(
    server: KubeApiServer, core: client.CoreV1Api
) -> None:
    server.create_namespace("other")
    server.create_pod("default", "p1", node_name="n1", phase="Running")
    server.create_pod("default", "p2", node_name="n2", phase="Pending")
    server.create_pod("other", "p3", node_name="n1", phase="Running")
    server.create_secret("other", "s", {"k": b"v"}, type="kubernetes.io/tls")
    server.create_configmap("other", "c")

    def pods(**kwargs: Any) -> list[tuple[str, str]]:
        items = core.list_pod_for_all_namespaces(**kwargs).items
        return [(p.metadata.namespace, p.metadata.name) for p in items]

    assert pods() == [("default", "p1"), ("default", "p2"), ("other", "p3")]
    assert pods(field_selector="spec.nodeName=n1") == [("default", "p1"), ("other", "p3")]
    assert pods(field_selector="spec.nodeName=n1,metadata.namespace=other") == [("other", "p3")]
    assert pods(field_selector="status.phase!=Running") == [("default", "p2")]
    assert pods(field_selector="metadata.name=p2") == [("default", "p2")]
    names = [p.metadata.name for p in core.list_namespaced_pod("other").items]
    assert names == ["p3"]
    secrets = core.list_secret_for_all_namespaces(field_selector="type=kubernetes.io/tls")
    assert [s.metadata.name for s in secrets.items] == ["s"]
    assert [c.metadata.name for c in core.list_config_map_for_all_namespaces().items] == ["c"]
    with pytest.raises(ApiException) as info:
        core.list_namespaced_config_map("default", field_selector="data.k=v")
    assert info.value.status == 400


def test_list_metadata_and_pagination(server: KubeApiServer, core: client.CoreV1Api) -> None:
    for i in range(5):
        server.create_configmap("default", f"cm-{i}")
    listing = core.list_namespaced_config_map("default")
    assert listing.kind == "ConfigMapList"
    assert listing.metadata.resource_version == str(server.resource_version)
    page = core.list_namespaced_config_map("default", limit=2)
    seen = [c.metadata.name for c in page.items]
    while page.metadata._continue:
        page = core.list_namespaced_config_map(
            "default", limit=2, _continue=page.metadata._continue
        )
        seen += [c.metadata.name for c in page.items]
    assert seen == [f"cm-{i}" for i in range(5)]


# -- watch -----------------------------------------------------------------------------------


def test_watch_replays_in_order_and_resumes(core: client.CoreV1Api) -> None:
    start_rv = core.list_namespaced_secret("default").metadata.resource_version
    core.create_namespaced_secret("default", secret("w", key="1"))
    core.patch_namespaced_secret("w", "default", {"stringData": {"key": "2"}})
    core.delete_namespaced_secret("w", "default")

    w = watch.Watch()
    stream = w.stream(
        core.list_namespaced_secret, "default", resource_version=start_rv, timeout_seconds=5
    )
    events = collect(stream, w, 3)
    assert [(t, n) for t, n, _ in events] == [("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w")]
    rvs = [int(rv) for _, _, rv in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3

    # Resuming from the MODIFIED event's version yields only what came after it.
    w2 = watch.Watch()
    stream = w2.stream(
        core.list_namespaced_secret, "default", resource_version=events[1][2], timeout_seconds=5
    )
    assert [(t, n) for t, n, _ in collect(stream, w2, 1)] == [("DELETED", "w")]


def test_live_watch_sees_changes_in_order(server: KubeApiServer, core: client.CoreV1Api) -> None:
    server.create_configmap("default", "existing")
    seen: list[tuple[str, str]] = []
    w = watch.Watch()
    ready = threading.Event()

    def consume() -> None:
        stream = w.stream(core.list_namespaced_config_map, "default", timeout_seconds=10)
        for event in stream:
            seen.append((event["type"], event["object"].metadata.name))
            ready.set()
            if len(seen) == 4:
                w.stop()

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert ready.wait(5)  # the synthetic ADDED for the existing object arrived
    core.create_namespaced_config_map("default", {"metadata": {"name": "new"}})
    core.patch_namespaced_config_map("new", "default", {"data": {"a": "b"}})
    core.delete_namespaced_config_map("new", "default")
    consumer.join(10)
    deadline = time.monotonic() + 5
    while server.store.watcher_count and time.monotonic() < deadline:
        time.sleep(0.05)  # the server notices the closed stream and drops the watcher
    assert server.store.watcher_count == 0
    assert seen == [
        ("ADDED", "existing"),
        ("ADDED", "new"),
        ("MODIFIED", "new"),
        ("DELETED", "new"),
    ]


def test_watch_selector_transitions(server: KubeApiServer, core: client.CoreV1Api) -> None:
    rv = str(server.resource_version)
    server.create_configmap("default", "c", labels={"mesh": "on"})
    server.patch("configmaps", "c", {"metadata": {"labels": {"mesh": "off"}}}, namespace="default")
    server.patch("configmaps", "c", {"metadata": {"labels": {"mesh": "on"}}}, namespace="default")
    server.create_configmap("default", "ignored")
    w = watch.Watch()
    stream = w.stream(
        core.list_namespaced_config_map,
        "default",
        label_selector="mesh=on",
        resource_version=rv,
        timeout_seconds=1,
    )
    events = [(e["type"], e["object"].metadata.name) for e in stream]
    assert events == [("ADDED", "c"), ("DELETED", "c"), ("ADDED", "c")]


def test_watch_reconnects_after_server_timeout() -> None:
    with running(watch_timeout=0.3) as (server, core):
        w = watch.Watch()
        names: list[str] = []

        def later() -> None:
            time.sleep(0.8)  # after at least one server-side stream end
            server.create_pod("default", "late")

        threading.Thread(target=later).start()
        # The client only reconnects when it knows a resourceVersion: list, then watch.
        rv = core.list_namespaced_pod("default").metadata.resource_version
        for event in w.stream(core.list_namespaced_pod, "default", resource_version=rv):
            names.append(event["object"].metadata.name)
            w.stop()
        assert names == ["late"]
        assert server.count("watch", "pods") >= 2


def test_watch_too_old_resource_version_is_gone(
    server: KubeApiServer, core: client.CoreV1Api
) -> None:
    old_rv = core.list_namespaced_secret("default").metadata.resource_version
    server.create_secret("default", "a")
    server.compact()
    w = watch.Watch()
    with pytest.raises(ApiException) as info:
        list(
            w.stream(
                core.list_namespaced_secret, "default", resource_version=old_rv, timeout_seconds=2
            )
        )
    assert info.value.status == 410
    # The current version is still fine.
    w2 = watch.Watch()
    fresh = w2.stream(
        core.list_namespaced_secret,
        "default",
        resource_version=str(server.resource_version),
        timeout_seconds=1,
    )
    assert list(fresh) == []


def test_bounded_history_expires_old_versions() -> None:
    with running(history_limit=3) as (server, core):
        rv = str(server.resource_version)
        for i in range(5):
            server.create_configmap("default", f"c{i}")
        with pytest.raises(ApiException) as info:
            list(
                watch.Watch().stream(
                    core.list_namespaced_config_map,
                    "default",
                    resource_version=rv,
                    timeout_seconds=1,
                )
            )
        assert info.value.status == 410
        recent = str(server.resource_version - 2)
        w = watch.Watch()
        stream = w.stream(
            core.list_namespaced_config_map,
            "default",
            resource_version=recent,
            timeout_seconds=1,
        )
        assert [e["object"].metadata.name for e in stream] == ["c3", "c4"]


def test_single_object_watch_with_bookmarks(server: KubeApiServer, core: client.CoreV1Api) -> None:
    server.create_pod("default", "a")
    server.create_pod("default", "b")
    w = watch.Watch()
    stream = w.stream(
        core.list_namespaced_pod,
        "default",
        field_selector="metadata.name=b",
        allow_watch_bookmarks=True,
        timeout_seconds=1,
    )
    events = [(e["type"], e["raw_object"]["metadata"].get("name")) for e in stream]
    assert events == [("ADDED", "b"), ("BOOKMARK", None)]
    assert w.resource_version == str(server.resource_version)


# -- TokenReview -----------------------------------------------------------------------------


def review(auth: client.AuthenticationV1Api, token: str, audiences: list[str] | None = None) -> Any:
    body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=audiences))
    return auth.create_token_review(body).status


def test_token_review(server: KubeApiServer, api_client: client.ApiClient) -> None:
    auth = client.AuthenticationV1Api(api_client)
    server.create_namespace("apps")
    pod = server.create_pod("apps", "web-0", uid="pod-uid-1", service_account="web")
    assert pod["metadata"]["uid"] == "pod-uid-1"
    server.add_service_account_token(
        "tok-web", "apps", "web", audiences=["istio-ca"], pod_name="web-0"
    )
    server.add_token("tok-plain", "alice", groups=["devs"])

    status = review(auth, "tok-web", ["istio-ca", "other"])
    assert status.authenticated is True
    assert status.audiences == ["istio-ca"]
    assert status.user.username == "system:serviceaccount:apps:web"
    assert "system:serviceaccounts:apps" in status.user.groups
    assert status.user.extra[POD_NAME_KEY] == ["web-0"]
    assert status.user.extra[POD_UID_KEY] == ["pod-uid-1"]

    mismatch = review(auth, "tok-web", ["kube-apiserver"])
    assert mismatch.authenticated is False
    assert "invalid" in mismatch.error

    # No requested audiences means the API server's own audiences.
    assert review(auth, "tok-web").authenticated is False
    plain = review(auth, "tok-plain")
    assert plain.authenticated is True
    assert plain.audiences == ["https://kubernetes.default.svc.cluster.local"]

    unknown = review(auth, "forged")
    assert unknown.authenticated is False and unknown.error

    server.add_token("tok-old", "bob", audiences=["istio-ca"], expires_at=time.time() - 1)
    assert review(auth, "tok-old", ["istio-ca"]).authenticated is False
    server.remove_token("tok-plain")
    assert review(auth, "tok-plain").authenticated is False
    assert server.tokenreview_count == 7

    with pytest.raises(ApiException) as info:
        review(auth, "")
    assert info.value.status == 422


def test_token_review_counter_supports_cache_assertions(
    server: KubeApiServer, api_client: client.ApiClient
) -> None:
    """The pattern meshca's authenticator tests use: a cache hit must make no API call."""
    auth = client.AuthenticationV1Api(api_client)
    server.add_service_account_token("t", "default", "sa", audiences=["istio-ca"])
    cache: dict[str, bool] = {}

    def authenticate(token: str) -> bool:
        if token not in cache:
            cache[token] = bool(review(auth, token, ["istio-ca"]).authenticated)
        return cache[token]

    assert authenticate("t")
    assert server.tokenreview_count == 1
    assert authenticate("t")
    assert server.tokenreview_count == 1
    assert server.count("create", "tokenreviews") == 1
    server.reset_counts()
    assert server.tokenreview_count == 0


def test_issued_tokens_verify_against_the_served_jwks(
    server: KubeApiServer, api_client: client.ApiClient
) -> None:
    """The issuer's discovery document and JWKS, read with the official client, verify the
    projected tokens it signs; the same token passes TokenReview; a rotated key is published
    beside the old one."""

    def get(fetch: Any) -> Any:
        return json.loads(fetch(_preload_content=False).data)

    discovery = get(
        client.WellKnownApi(api_client).get_service_account_issuer_open_id_configuration
    )
    server.create_pod("default", "app-1", service_account="sa", uid="uid-1")
    token = server.issue_service_account_token(
        "default", "sa", audiences=["istio-ca"], pod_name="app-1"
    )
    keys = jwt.PyJWKSet.from_dict(
        get(client.OpenidApi(api_client).get_service_account_issuer_open_id_keyset)
    )
    header = jwt.get_unverified_header(token)
    key = next(key for key in keys.keys if key.key_id == header["kid"])
    claims = jwt.decode(
        token, key=key, algorithms=[header["alg"]], audience="istio-ca", issuer=discovery["issuer"]
    )
    assert claims["sub"] == "system:serviceaccount:default:sa"
    assert claims["kubernetes.io"]["pod"] == {"name": "app-1", "uid": "uid-1"}
    status = review(client.AuthenticationV1Api(api_client), token, ["istio-ca"])
    assert status.authenticated and status.user.extra[POD_UID_KEY] == ["uid-1"]

    old_kid = header["kid"]
    new_kid = server.issuer.rotate()
    published = {
        key["kid"]
        for key in get(client.OpenidApi(api_client).get_service_account_issuer_open_id_keyset)[
            "keys"
        ]
    }
    assert published == {old_kid, new_kid}
    assert server.count("get", "/openid/v1/jwks") == 2
    assert server.count("get", "/.well-known/openid-configuration") == 1


# -- counters, auth, kubeconfig, subprocess ----------------------------------------------------


def test_request_counts_per_verb_and_resource(
    server: KubeApiServer, core: client.CoreV1Api
) -> None:
    server.create_pod("default", "p")  # seeding is not an API request
    core.read_namespaced_pod("p", "default")
    core.read_namespaced_pod("p", "default")
    core.list_pod_for_all_namespaces()
    core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"}})
    assert server.count("get", "pods") == 2
    assert server.count("list", "pods") == 1
    assert server.count("patch", "pods/status") == 1
    assert server.count(resource="pods") == 3
    assert server.request_counts() == {
        ("get", "pods"): 2,
        ("list", "pods"): 1,
        ("patch", "pods/status"): 1,
    }
    assert [r.code for r in server.requests()] == [200, 200, 200, 200]


def test_kubeconfig_and_required_bearer_token(tmp_path: Path) -> None:
    with KubeApiServer(auth_token="s3cret") as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        with client.ApiClient(cfg) as api:
            names = {n.metadata.name for n in client.CoreV1Api(api).list_namespace().items}
        assert {"default", "kube-system"} <= names

        bad = server.write_kubeconfig(tmp_path / "bad", token="wrong")
        with (
            config.new_client_from_config(config_file=str(bad)) as api,
            pytest.raises(ApiException) as info,
        ):
            client.CoreV1Api(api).list_namespace()
        assert info.value.status == 401


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        assert proc.poll() is None, "server process exited early"
        time.sleep(0.05)
    raise AssertionError("port file never appeared")


def test_subprocess_entry_point(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps(
            [
                {
                    "token": "t1",
                    "namespace": "default",
                    "serviceAccount": "sa",
                    "audiences": ["istio-ca"],
                }
            ]
        )
    )
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.kube_api",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--tokens-file",
            str(tokens),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        port = int(_wait_for_file(port_file, proc))
        url = f"http://127.0.0.1:{port}"
        with client.ApiClient(client.Configuration(host=url)) as api:
            core = client.CoreV1Api(api)
            core.create_namespaced_config_map("default", {"metadata": {"name": "x"}})
            assert core.read_namespaced_config_map("x", "default").metadata.name == "x"
            auth = client.AuthenticationV1Api(api)
            assert review(auth, "t1", ["istio-ca"]).authenticated is True

            request = urllib.request.Request(
                f"{url}/_test/tokens",
                data=json.dumps({"token": "t2", "username": "u"}).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            urllib.request.urlopen(request, timeout=5).close()
            assert review(auth, "t2").authenticated is True

            pod = {"kind": "Pod", "metadata": {"name": "seeded", "namespace": "default"}}
            seed = urllib.request.Request(
                f"{url}/_test/objects",
                data=json.dumps(pod).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            urllib.request.urlopen(seed, timeout=5).close()
            assert core.read_namespaced_pod("seeded", "default").status.phase == "Pending"
        assert race_create(url, "raced", 3) == [201, 409, 409]
        with urllib.request.urlopen(f"{url}/_test/counts", timeout=5) as resp:
            counts = {(c["verb"], c["resource"]): c["count"] for c in json.load(resp)}
        assert counts[("create", "tokenreviews")] == 2
        assert counts[("create", "configmaps")] == 1
        assert counts[("create", "secrets")] == 3

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
