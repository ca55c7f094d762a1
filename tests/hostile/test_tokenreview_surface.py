"""Kubernetes TokenReview under hostile load (issue #11 item 7 and Done-means 4): a shared review
survives its first caller going away, refused tokens are remembered briefly, and a flood of
1,000 invalid-token requests costs the API server a bounded number of reviews while a valid
request is still served promptly. Real fake-API-server over HTTP, real gRPC CA in-process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import jwt
import pytest

from ca_server.authn import AuthenticatorChain, AuthnRequest, Caller
from ca_server.config import KubeConfig
from ca_server.errors import AuthenticationError
from ca_server.kube.clients import KubeClients
from ca_server.kube.ratelimit import AsyncTokenBucket
from ca_server.kube.tokenreview import TokenReviewAuthenticator
from ca_server.loop_handoff import mark_inline_thread
from ca_server.metrics import CaMetrics
from ca_server.serving import cq_calls
from meshca.clock import Clock, FakeClock, SystemClock
from meshca_proto import ca_pb2, ca_pb2_grpc
from tests.support.inprocess_ca import InProcessCa, good_csr
from tests.support.kube_api import Fault, KubeApiServer

VALID = "valid-sleep-token"


@pytest.fixture
def kube_api(starts_processes: None) -> Iterator[KubeApiServer]:
    with KubeApiServer() as server:
        server.add_service_account_token(VALID, "default", "sleep", audiences=["istio-ca"])
        yield server


@pytest.fixture
def clients(kube_api: KubeApiServer, tmp_path: Path) -> Iterator[KubeClients]:
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    built = KubeClients.from_config(KubeConfig(kubeconfig=kubeconfig))
    yield built
    built.close()


def _authenticator(clients: KubeClients, clock: Clock | None = None) -> TokenReviewAuthenticator:
    return TokenReviewAuthenticator(
        clients,
        audiences=["istio-ca"],
        trust_domain="cluster.local",
        limiter=AsyncTokenBucket(50, 100, SystemClock()),
        metrics=CaMetrics(),
        clock=clock or SystemClock(),
    )


def _request(token: str) -> AuthnRequest:
    return AuthnRequest(headers={"authorization": f"Bearer {token}"})


def test_a_review_that_ends_while_a_request_moves_to_the_loop_is_not_made_again(
    kube_api: KubeApiServer, clients: KubeClients
) -> None:
    """On the completion-queue server a request with a new token looks up the remembered answers
    on the CQ thread, then moves to the loop (`loop_handoff.to_the_loop`) to start or join the
    token's review. A review of the same token can finish in between: the request must take
    its answer, not start a second review (the flood test's bound: one per distinct token)."""
    authenticator = _authenticator(clients)

    async def scenario() -> None:
        mark_inline_thread()  # the first step as the completion-queue thread runs it
        try:
            moved = authenticator.authenticate(_request("forged-token"))
            assert moved.send(None) is None  # nothing remembered: it asks for the loop
        finally:
            mark_inline_thread(False)
        with pytest.raises(AuthenticationError):  # another request, reviewed to the end
            await authenticator.authenticate(_request("forged-token"))
        assert kube_api.tokenreview_count == 1
        with pytest.raises(AuthenticationError):  # the first resumes on the loop, as the server
            await cq_calls.Resume(moved, None)  # resumes a handed-over handler
        assert kube_api.tokenreview_count == 1, "the token was reviewed twice"

    asyncio.run(scenario())


def test_a_cancelled_first_caller_does_not_cancel_the_shared_review(
    kube_api: KubeApiServer, clients: KubeClients
) -> None:
    """Before: the review ran in the first caller's task; when that RPC was cancelled every
    other request waiting on the same token got CANCELLED."""
    kube_api.faults.add(Fault("create", "tokenreviews", delay=0.5, times=1))
    authenticator = _authenticator(clients)

    async def scenario() -> Caller:
        first = asyncio.create_task(authenticator.authenticate(_request(VALID)))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(authenticator.authenticate(_request(VALID)))
        await asyncio.sleep(0.1)
        first.cancel()
        caller = await asyncio.wait_for(second, 5)
        assert caller is not None
        return caller

    caller = asyncio.run(scenario())
    assert caller.identity.uri == "spiffe://cluster.local/ns/default/sa/sleep"
    assert kube_api.tokenreview_count == 1


def test_refused_tokens_are_remembered_for_the_negative_ttl_only(
    kube_api: KubeApiServer, clients: KubeClients
) -> None:
    """Before: failed reviews were not cached, so retrying a bad token spent one API call per
    request."""
    clock = FakeClock(datetime.now(UTC))
    authenticator = _authenticator(clients, clock)

    async def attempt() -> str:
        try:
            await authenticator.authenticate(_request("forged-token"))
        except AuthenticationError as exc:
            return exc.reason
        return "accepted"

    async def scenario() -> list[str]:
        reasons = [await attempt() for _ in range(20)]
        clock.advance(timedelta(seconds=6))  # past the 5 s negative TTL
        reasons.append(await attempt())
        return reasons

    reasons = asyncio.run(scenario())
    assert set(reasons) == {"token-rejected"}
    assert kube_api.tokenreview_count == 2


def test_a_transient_api_failure_is_not_remembered(
    kube_api: KubeApiServer, clients: KubeClients
) -> None:
    kube_api.faults.add(Fault("create", "tokenreviews", status=500, times=1))
    authenticator = _authenticator(clients)

    async def scenario() -> Caller | None:
        with pytest.raises(Exception, match="retry later"):
            await authenticator.authenticate(_request(VALID))
        return await authenticator.authenticate(_request(VALID))

    assert asyncio.run(scenario()) is not None
    assert kube_api.tokenreview_count == 2


def test_an_expired_jwt_is_refused_without_a_review(
    kube_api: KubeApiServer, clients: KubeClients
) -> None:
    expired = jwt.encode({"exp": int(time.time()) - 3600, "sub": "x"}, "k" * 32, "HS256")
    authenticator = _authenticator(clients)
    with pytest.raises(AuthenticationError, match="expired"):
        asyncio.run(authenticator.authenticate(_request(expired)))
    assert kube_api.tokenreview_count == 0


def test_a_flood_of_1000_invalid_tokens_costs_few_reviews_and_a_valid_request_is_served(
    kube_api: KubeApiServer, clients: KubeClients, tmp_path: Path
) -> None:
    """Done-means 4. The flood: one forged token sent 600 times, 10 further unknown tokens 20
    times each, 200 distinct expired JWTs; 32 concurrent senders. The API server must see at
    most one review per distinct unexpired token (11), every request must be refused
    UNAUTHENTICATED with nothing issued, and a valid request sent mid-flood must succeed
    promptly (under 2 s on a loaded 2-core machine)."""
    authenticator = _authenticator(clients)
    ca = InProcessCa(tmp_path, authenticators=AuthenticatorChain([authenticator]))
    kube_api.faults.add(Fault("create", "tokenreviews", delay=0.05))  # a busy API server
    now = int(time.time())
    tokens = ["forged-token"] * 600 + [f"unknown-{i % 10}" for i in range(200)]
    tokens += [jwt.encode({"exp": now - 600, "i": i}, "k" * 32, "HS256") for i in range(200)]
    with ca:
        csr = good_csr()  # the CSR is never looked at: authentication fails first

        def sender(batch: list[str]) -> list[grpc.StatusCode | None]:
            """One attacker connection sending its share of the flood back to back."""
            codes: list[grpc.StatusCode | None] = []
            with ca.channel() as channel:
                stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
                for token in batch:
                    try:
                        stub.CreateCertificate(
                            ca_pb2.IstioCertificateRequest(csr=csr),
                            metadata=[("authorization", f"Bearer {token}")],
                            timeout=10,
                        )
                        codes.append(None)
                    except grpc.RpcError as error:
                        codes.append(error.code())
            return codes

        batches = [tokens[i::32] for i in range(32)]
        with ThreadPoolExecutor(32) as pool:
            flood = [pool.submit(sender, batch) for batch in batches]
            time.sleep(0.3)
            started = time.monotonic()
            chain = ca.call(good_csr(), token=VALID)
            valid_latency = time.monotonic() - started
            codes = [code for future in flood for code in future.result()]

        assert chain and "BEGIN CERTIFICATE" in chain[0]
        assert valid_latency < 2.0, f"the valid request took {valid_latency:.2f}s"
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 1000
        assert ca.issued_count() == 1
        assert len(ca.denied_lines()) == 1000
        reviews = kube_api.tokenreview_count
        assert reviews <= 12, f"{reviews} TokenReviews for 11 distinct unexpired bad tokens + 1"
