"""Kubernetes TokenReview authentication (`authentication.k8s.io/v1`), as Istio does it.

The API server decides whether a bearer token is valid for our audiences; this module then
accepts only service-account users: `authenticated: true`, groups containing
`system:serviceaccounts`, username `system:serviceaccount:<ns>:<sa>`. A pod-bound token also
names its pod in `user.extra`, which the node authorizer needs.

Outcomes: API says no → `AuthenticationError` (UNAUTHENTICATED, not retried); API unreachable
or erroring → `DependencyUnavailableError` (UNAVAILABLE, clients retry).

Spending the API server's rate limit: a verified token is remembered until it expires (at most
five minutes); a token the API server *refused* is remembered for `negative_ttl` (default
5 s), so a client retrying a bad token in a loop, or a flood of requests carrying one forged
token, costs one review per token per `negative_ttl` instead of one per request. The TTL is
short because a refusal can be transient on the API server's side (a pod just created, keys
being rotated) and a legitimate workload must not stay locked out. A JWT past its `exp` is
refused without a review (the API server would refuse it too). Transient API errors are never
remembered.

An advisory request (an agent report, `AuthnRequest.advisory`) gets a review only from the
bucket's spare tokens (`AsyncTokenBucket.take_spare`), never a reserved slot: when there is none
it is refused with `OverloadedError` (UNAVAILABLE and a retry hint) instead of queueing ahead of
certificate requests. Cache hits and a review already under way for the same token cost nothing
and are always served.

Concurrency: `authenticate` answers from its caches wherever the RPC server runs the handler (its
completion-queue thread, or the event loop); a token it has to review moves the handler to the
loop first (`loop_handoff.to_the_loop`), so the reviews in flight, their tasks and the bucket's
waits are the loop's alone. The review itself is a blocking HTTP call on the synchronous
client, so it runs in a worker thread (`asyncio.to_thread`) after the token bucket admits it.
Concurrent requests with the same token share one review, run as a task of its own: a caller
that goes away (deadline, cancelled RPC) stops waiting but does not cancel the review the
others are waiting for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.authn import AuthnRequest, Caller
from ca_server.errors import (
    AuthenticationError,
    DependencyUnavailableError,
    OverloadedError,
    clip,
)
from ca_server.kube.clients import KubeClients
from ca_server.kube.ratelimit import AsyncTokenBucket
from ca_server.loop_handoff import to_the_loop
from ca_server.metrics import CaMetrics
from ca_server.token_cache import VerifiedTokenCache, token_digest, token_expiry, token_shape
from ca_server.wire import RETRY_PUSHBACK_TRAILER
from certs import CertsError, SpiffeId
from meshca.accounts import account_from_username
from meshca.clock import Clock
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

SERVICE_ACCOUNTS_GROUP = "system:serviceaccounts"
POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
POD_UID_KEY = "authentication.kubernetes.io/pod-uid"
_REQUEST_TIMEOUT = (2.0, 5.0)  # (connect, read) seconds: a slow API server must not pile up
DEFAULT_NEGATIVE_TTL = timedelta(seconds=5)
_EXP_LEEWAY = timedelta(seconds=30)


def caller_from_review(status: Any, trust_domain: str, cluster_id: str) -> Caller:
    """The `Caller` a TokenReview status vouches for, or `AuthenticationError` saying why not.

    `status` is a `V1TokenReviewStatus`; kept duck-typed so tests can hand in plain objects.
    """
    if status is None or not status.authenticated:
        error = (status.error if status is not None else None) or "no reason given"
        raise AuthenticationError(
            "token-rejected",
            f"the Kubernetes API server (cluster {cluster_id}) rejected the token: {error}; "
            "send a current projected service-account token with audience istio-ca",
        )
    user = status.user
    username = (user.username if user else None) or ""
    groups = (user.groups if user else None) or []
    if SERVICE_ACCOUNTS_GROUP not in groups:
        raise AuthenticationError(
            "token-not-service-account",
            f"token authenticates {username or 'an unnamed user'}, which is not in group "
            f"{SERVICE_ACCOUNTS_GROUP}: only service-account tokens are accepted",
        )
    account = account_from_username(username)
    if account is None:
        raise AuthenticationError(
            "token-not-service-account",
            f"token authenticates {username!r}, not system:serviceaccount:<namespace>:<name>",
        )
    namespace, service_account = account
    try:
        identity = SpiffeId(trust_domain, namespace, service_account)
    except CertsError as exc:
        raise AuthenticationError("token-not-service-account", f"token user: {exc}") from exc
    extra = (user.extra if user else None) or {}
    return Caller(
        identity,
        TokenReviewAuthenticator.name,
        subject=username,
        pod_name=_first(extra.get(POD_NAME_KEY)),
        pod_uid=_first(extra.get(POD_UID_KEY)),
        extra={"cluster_id": cluster_id},
    )


def _first(values: Sequence[str] | None) -> str | None:
    return values[0] if values else None


def _refuse_expired_token(token: str, now: datetime) -> None:
    """Refuses, without an API call, a JWT past its `exp` (the API server would refuse it).
    Opaque tokens always go to the API server: it, not the CA, knows what they are."""
    shape = token_shape(token)
    if shape is not None and shape.expires is not None and shape.expires + _EXP_LEEWAY <= now:
        raise AuthenticationError(
            "token-rejected",
            "token has expired; the kubelet refreshes projected tokens: re-read the token file",
        )


class TokenReviewAuthenticator:
    name = "kubernetes-tokenreview"

    def __init__(
        self,
        clients: KubeClients,
        *,
        audiences: Sequence[str],
        trust_domain: str,
        limiter: AsyncTokenBucket,
        metrics: CaMetrics,
        clock: Clock,
        cache: VerifiedTokenCache[Caller] | None = None,
        negative_ttl: timedelta = DEFAULT_NEGATIVE_TTL,
    ) -> None:
        self._clients = clients
        self._audiences = list(audiences)
        self._trust_domain = trust_domain
        self._limiter = limiter
        self._metrics = metrics
        self._clock = clock
        self._cache: VerifiedTokenCache[Caller] = cache or VerifiedTokenCache()
        self._refusals: VerifiedTokenCache[AuthenticationError] = VerifiedTokenCache(
            max_ttl=negative_ttl
        )
        self._in_flight: dict[str, asyncio.Task[Caller]] = {}

    async def authenticate(self, request: AuthnRequest) -> Caller | None:
        token = request.bearer_token
        if token is None:
            return None
        cluster_id = request.cluster_id or self._clients.local_cluster_id
        api = self._clients.for_cluster(cluster_id)
        if api is None:
            raise AuthenticationError(
                "unknown-cluster",
                f"clusterid {clip(cluster_id)!r} is not a cluster this CA can review tokens "
                "for; configure it with --remote-kubeconfig",
            )
        digest = token_digest(cluster_id, token)
        now = self._clock.now()
        cached = self._remembered(digest, now)
        if cached is not None:
            return cached
        _refuse_expired_token(token, now)
        # A new token: what follows creates and joins a task, so it runs on the loop.
        await to_the_loop()
        review = self._in_flight.get(digest)
        if review is None:
            # The hop to the loop may have let a review of this very token finish (its answer
            # is remembered, and it is no longer in flight): one review per token, not two.
            cached = self._remembered(digest, self._clock.now())
            if cached is not None:
                return cached
            paid = request.advisory and self._spare_token()
            review = asyncio.create_task(
                self._review_and_remember(api, token, cluster_id, digest, paid=paid)
            )
            self._in_flight[digest] = review
            review.add_done_callback(lambda task: self._review_done(digest, task))
        return await asyncio.shield(review)

    def _remembered(self, digest: str, now: datetime) -> Caller | None:
        """The caller a review of this token found, or its refusal raised again (counted by the
        service as a denial, like the first time); `None` for a token not reviewed lately."""
        cached = self._cache.get(digest, now)
        if cached is not None:
            self._metrics.tokenreview_cache_hits.inc()
            return cached
        refusal = self._refusals.get(digest, now)
        if refusal is not None:
            raise AuthenticationError(refusal.reason, refusal.message)
        return None

    def _spare_token(self) -> bool:
        """True once a spare token is taken; `OverloadedError` when there is none."""
        wait = self._limiter.take_spare()
        if wait > 0:
            raise OverloadedError(
                "tokenreview-budget",
                "the CA keeps its Kubernetes API budget (TokenReview) for certificate requests "
                "right now; this advisory request can wait: retry after the "
                f"{RETRY_PUSHBACK_TRAILER} hint",
                retry_after_ms=min(30_000, max(50, int(wait * 1000))),
            )
        return True

    async def _review_and_remember(
        self,
        api: kubernetes.client.ApiClient,
        token: str,
        cluster_id: str,
        digest: str,
        *,
        paid: bool = False,
    ) -> Caller:
        try:
            caller = await self._review(api, token, cluster_id, paid=paid)
        except AuthenticationError as exc:
            self._refusals.put(digest, exc, self._clock.now(), None)
            raise
        self._cache.put(digest, caller, self._clock.now(), token_expiry(token))
        return caller

    def _review_done(self, digest: str, task: asyncio.Task[Caller]) -> None:
        if self._in_flight.get(digest) is task:
            del self._in_flight[digest]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone away

    async def _review(
        self, api: kubernetes.client.ApiClient, token: str, cluster_id: str, *, paid: bool
    ) -> Caller:
        """One TokenReview, after a token from the bucket unless the caller `paid` one."""
        if not paid:
            await self._limiter.acquire()
        try:
            review = await asyncio.to_thread(self._create_review, api, token)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            self._metrics.tokenreview_requests.labels("error").inc()
            if isinstance(exc, ApiException):
                detail = f"HTTP {exc.status} {exc.reason}"
                cause = api_error_text(exc)  # the server's message: for the log only
            else:
                detail = cause = type(exc).__name__
            log.warning("TokenReview against cluster %s failed: %s", cluster_id, cause)
            raise DependencyUnavailableError(
                "tokenreview-unavailable",
                f"could not verify the token with the Kubernetes API server (cluster "
                f"{cluster_id}): {detail}; retry later",
            ) from exc
        try:
            caller = caller_from_review(review.status, self._trust_domain, cluster_id)
        except AuthenticationError:
            self._metrics.tokenreview_requests.labels("rejected").inc()
            raise
        self._metrics.tokenreview_requests.labels("authenticated").inc()
        return caller

    def _create_review(self, api: kubernetes.client.ApiClient, token: str) -> Any:
        body = kubernetes.client.V1TokenReview(
            api_version="authentication.k8s.io/v1",
            kind="TokenReview",
            spec=kubernetes.client.V1TokenReviewSpec(token=token, audiences=self._audiences),
        )
        return kubernetes.client.AuthenticationV1Api(api).create_token_review(
            body, _request_timeout=_REQUEST_TIMEOUT
        )
