"""Offline validation of pod-bound service-account tokens: no API call per certificate.

TokenReview asks the API server, for every new token, what this module works out locally:
1. the JWT is signed by the cluster's service-account issuer (keys from
   `ca_server.kube.issuer_keys`), its `iss` is that issuer, its `aud` holds an accepted audience
   (istio-ca), and `exp`/`nbf` hold — all by `ca_server.jwt_authn.JwtAuthenticator`, whose
   verified-token cache makes a repeated token cost one digest;
2. the token is bound to a pod, and that pod — from the CA's pod informer, checked on *every*
   request, cache hit or not — exists with the token's pod uid (not a deleted pod's namesake),
   runs as the token's service account and has not finished (`meshca.pods`: phase Succeeded
   or Failed). Deleting a pod therefore revokes its tokens as soon as the watch delivers the
   deletion, as TokenReview's bound-object check does;
3. the token's ServiceAccount — from the CA's ServiceAccount informer, also on every request —
   exists with the uid the token names, so deleting an account (or deleting and re-creating it
   under the same name) revokes its tokens as TokenReview's service-account check does, even
   while the pods that ran as it keep running.

What TokenReview accepts and this refuses: tokens bound to a Secret or Node rather than a pod,
and legacy Secret-based tokens. `docs/kubernetes.md` weighs this against TokenReview's API
cost.

Until both caches have completed their first list (a big cluster takes a while), tokens go to
`until_synced` — TokenReview — instead of being refused: a CA that just started serves its
cluster at TokenReview's pace rather than not at all.

Only tokens of the local cluster are validated here: the pod informer knows only its pods. A
request naming a remote cluster (`clusterid`) is left to TokenReview (`RemoteClustersOnly`).

Concurrency: runs on the event loop; reads the pod and ServiceAccount caches (dictionary lookups
under locks held for no I/O) and awaits the key source, which fetches in a worker thread.
"""

from __future__ import annotations

from dataclasses import replace

from ca_server.authn import Authenticator, AuthnRequest, Caller
from ca_server.errors import AuthenticationError
from ca_server.jwt_authn import JwtAuthenticator
from ca_server.kube.pod_cache import PodLookup
from ca_server.kube.service_account_cache import AccountLookup
from ca_server.kube.watched_cache import syncing_error


class BoundTokenAuthenticator:
    """Local-cluster bearer tokens, verified against the issuer's keys and the pod and
    ServiceAccount informers."""

    name = "kubernetes-offline"

    def __init__(
        self,
        verifier: JwtAuthenticator,
        pods: PodLookup,
        accounts: AccountLookup,
        cluster_id: str,
        until_synced: Authenticator | None = None,
    ) -> None:
        self._until_synced = until_synced
        self._verifier = verifier
        self._pods = pods
        self._accounts = accounts
        self._cluster_id = cluster_id

    async def authenticate(self, request: AuthnRequest) -> Caller | None:
        if request.bearer_token is None:
            return None
        if request.cluster_id not in (None, self._cluster_id):
            return None  # another cluster's token: its pods are not in this informer
        if self._until_synced is not None and not (self._pods.synced and self._accounts.synced):
            return await self._until_synced.authenticate(request)
        caller = await self._verifier.authenticate(request)
        if caller is None:
            return None
        await self._check_bound_pod(caller)
        await self._check_account(caller)
        return replace(caller, authenticator=self.name, extra={"cluster_id": self._cluster_id})

    async def _check_bound_pod(self, caller: Caller) -> None:
        namespace, account = caller.identity.namespace, caller.identity.service_account
        if not caller.pod_name or not caller.pod_uid:
            raise AuthenticationError(
                "token-not-pod-bound",
                f"token of {namespace}/{account} is not bound to a pod; offline validation "
                "accepts only projected pod-bound tokens (or run the CA with "
                "--token-validation tokenreview)",
            )
        if not self._pods.synced:
            raise syncing_error(
                self._pods.progress(), "pod-cache-not-synced", "offline token validation"
            )
        where = f"pod {namespace}/{caller.pod_name}"
        pod = await self._pods.fetch(namespace, caller.pod_name)
        if pod is None:
            raise AuthenticationError(
                "token-pod-not-found",
                f"token is bound to {where}, which does not exist (deleted?): send the token "
                "of a running pod",
            )
        if pod.uid != caller.pod_uid:
            raise AuthenticationError(
                "token-pod-uid-mismatch",
                f"token is bound to {where} with uid {caller.pod_uid}, but that pod now has uid "
                f"{pod.uid} (the token belongs to a deleted pod of the same name)",
            )
        if pod.service_account != account:
            raise AuthenticationError(
                "token-pod-account-mismatch",
                f"token is for service account {account}, but {where} runs as "
                f"{pod.service_account}",
            )
        if not pod.live:
            raise AuthenticationError(
                "token-pod-finished",
                f"token is bound to {where}, which has finished (phase {pod.phase})",
            )

    async def _check_account(self, caller: Caller) -> None:
        namespace, account = caller.identity.namespace, caller.identity.service_account
        if not self._accounts.synced:
            raise syncing_error(
                self._accounts.progress(),
                "service-account-cache-not-synced",
                "offline token validation",
            )
        where = f"service account {namespace}/{account}"
        uid = await self._accounts.fetch_uid(namespace, account)
        if uid is None:
            raise AuthenticationError(
                "token-service-account-not-found",
                f"token is for {where}, which does not exist (deleted?): its tokens are "
                "revoked; send the token of an existing service account",
            )
        if not caller.service_account_uid or caller.service_account_uid != uid:
            raise AuthenticationError(
                "token-service-account-uid-mismatch",
                f"token is for {where} with uid {caller.service_account_uid or '(none)'}, but "
                f"that service account now has uid {uid} (the token belongs to a deleted "
                "account of the same name)",
            )


class RemoteClustersOnly:
    """Passes requests that name another cluster to `inner` (TokenReview there); declines the
    local cluster's, which `BoundTokenAuthenticator` decides without an API call."""

    def __init__(self, inner: Authenticator, local_cluster_id: str) -> None:
        self._inner = inner
        self._local_cluster_id = local_cluster_id
        self.name = inner.name

    async def authenticate(self, request: AuthnRequest) -> Caller | None:
        if request.cluster_id in (None, self._local_cluster_id):
            return None
        return await self._inner.authenticate(request)
