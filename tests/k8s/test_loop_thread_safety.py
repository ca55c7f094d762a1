"""No handler step on the completion-queue thread touches the CA's event loop unsafely.

The completion-queue server (`ca_server.serving.cq_server`) runs each handler's first step on
its own thread and hands a handler that waits to the CA's loop. A step that created a task, a
timer or a future callback on that thread would mutate the loop's queues from outside it (and
leave the callback unrun while the loop sleeps). asyncio's debug mode (`PYTHONASYNCIODEBUG=1`)
refuses exactly that ("Non-thread-safe operation invoked on an event loop other than the current
one"), so a real CA runs here in debug mode on the completion-queue server, is sent requests
whose tokens it has never seen (the paths that wait: a TokenReview, the cluster's issuer keys
after a rotation, a JWKS file, a JWKS URL) and must answer every one with no such line in its
log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

from certs import SpiffeId, build_csr, generate_private_key
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.jwks_http import serve_jwks
from tests.support.kube_api import KubeApiServer
from tests.support.kube_mode import CaFactory, issue, spiffe
from tests.support.token_issuer import K8S_ISSUER, RsaIssuer, make_rsa_issuer

DEBUG = {"PYTHONASYNCIODEBUG": "1"}
CQ = ("--rpc-server", "completion-queue", "--no-root-configmaps")
AUDIENCE = ["istio-ca"]


def unsafe_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "non-thread-safe" in line.lower()]


def all_at_once(calls: list[Callable[[], list[str]]]) -> list[list[str]]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def assert_debug_mode_and_safe(ca: CaProcess) -> None:
    log = ca.log()
    assert "completion-queue" in log, "the CA must run the completion-queue server"
    assert unsafe_lines(log) == [], log


def test_tokenreview_requests(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    for index in range(12):
        kube_api.add_service_account_token(f"t-{index}", "shop", "cart", audiences=AUDIENCE)
    ca = kube_ca("ca-0", *CQ, start=False)
    ca.env.update(DEBUG)
    ca.start()
    identity = spiffe("shop", "cart")
    # New tokens at once, two requests each (the second shares the first's review), then again
    # from the cache (inline), then a token the API server refuses.
    chains = all_at_once([partial(issue, ca, f"t-{i % 12}", identity) for i in range(24)])
    assert all(len(chain) == 2 for chain in chains)
    assert kube_api.tokenreview_count == 12
    assert len(issue(ca, "t-0", identity)) == 2
    with pytest.raises(Exception, match=r"rejected|lookup failed"):
        issue(ca, "unknown", identity)
    assert_debug_mode_and_safe(ca)


def test_issuer_keys_refreshed_after_a_rotation(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.create_namespace("shop")
    kube_api.create_pod("shop", "cart-1", service_account="cart", node_name="node-a")
    ca = kube_ca("ca-0", *CQ, "--token-validation", "offline", start=False)
    ca.env.update(DEBUG)
    ca.start()
    identity = spiffe("shop", "cart")

    def token() -> str:
        return kube_api.issue_service_account_token(
            "shop", "cart", audiences=AUDIENCE, pod_name="cart-1"
        )

    assert len(issue(ca, token(), identity)) == 2
    kube_api.issuer.rotate()  # tokens now name a key id the CA has not fetched
    chains = all_at_once([lambda: issue(ca, token(), identity) for _ in range(8)])
    assert all(len(chain) == 2 for chain in chains)
    assert_debug_mode_and_safe(ca)


@pytest.fixture
def issuer_and_url(tmp_path: Path) -> Iterator[tuple[RsaIssuer, str]]:
    """An RS256 issuer (its JWKS written to a file) and the URL serving the same JWKS."""
    issuer = make_rsa_issuer(tmp_path)
    with serve_jwks(issuer.jwks_path.read_bytes()) as url:
        yield issuer, url


@pytest.mark.process  # starts a CA
@pytest.mark.parametrize("source", ["file", "url"])
def test_jwks_requests(tmp_path: Path, issuer_and_url: tuple[RsaIssuer, str], source: str):
    issuer, url = issuer_and_url
    jwks = str(issuer.jwks_path) if source == "file" else url
    ca = CaProcess(tmp_path / "data", "--jwks", jwks, "--jwt-issuer", K8S_ISSUER, *CQ, env=DEBUG)
    ca.start()
    try:
        root = ca.root_cert_path.read_bytes()
        sleep = SpiffeId("cluster.local", "default", "sleep")

        def new_token_request(age: int) -> list[str]:
            token = issuer.token("default", "sleep", issued_at=time.time() - age)
            csr = build_csr(generate_private_key(), sleep)
            with ca_stub(ca.addr, root) as stub:
                return create_certificate(stub, csr, token=token)

        chains = all_at_once([partial(new_token_request, age) for age in range(12)])
        assert all(len(chain) == 2 for chain in chains)
        assert_debug_mode_and_safe(ca)
    finally:
        ca.stop()
