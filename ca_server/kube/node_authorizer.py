"""May a node agent (ztunnel) be issued another workload's identity? Istio's node authorizer.

Allowed only if every check passes, in this order (each failure has its own audit `reason`):
1. the caller's service account is in `CA_TRUSTED_NODE_ACCOUNTS`, and its token was vouched for
   by this cluster's API server (the pod cache knows only this cluster's pods);
2. its token is bound to a pod, that pod exists, has the token's pod uid (not a deleted pod's
   namesake) and runs as the caller's service account, and is scheduled on a node;
3. the requested identity is in this CA's trust domain, and a live pod (not Succeeded/Failed,
   `meshca.pods`) with that namespace and service account is scheduled on the caller's node.
So a compromised node agent can obtain only identities of workloads on its own node.

Denials are UNAUTHENTICATED to the caller (as Istio), with the precise reason in the message,
the log and the audit line. Before the pod cache has synced, requests get UNAVAILABLE.

Cost: every check is a dictionary lookup in the `PodCache` — the last one in its index on
(node, namespace, service account) — so a decision costs the same with 10 or 2,000 pods on the
node (`bench/node_authorizer.py`).

Concurrency: `authorize` runs on the event loop and only reads the `PodCache` (no API calls).
"""

from __future__ import annotations

from collections.abc import Collection

from ca_server.authn import Caller
from ca_server.errors import AuthenticationError
from ca_server.kube.pod_cache import PodLookup
from ca_server.kube.watched_cache import syncing_error
from certs import SpiffeId


class NodeAuthorizer:
    def __init__(
        self,
        trusted_accounts: Collection[tuple[str, str]],
        pods: PodLookup,
        trust_domain: str,
        cluster_id: str,
    ) -> None:
        self._trusted = frozenset(trusted_accounts)
        self._pods = pods
        self._trust_domain = trust_domain
        self._cluster_id = cluster_id

    async def authorize(self, caller: Caller, target: SpiffeId) -> None:
        who = caller.identity
        prefix = f"{who.uri} may not impersonate {target.uri}"
        if (who.namespace, who.service_account) not in self._trusted:
            raise AuthenticationError(
                "impersonation-untrusted-caller",
                f"{prefix}: {who.namespace}/{who.service_account} is not a trusted node account "
                "(CA_TRUSTED_NODE_ACCOUNTS)",
            )
        caller_cluster = caller.extra.get("cluster_id", self._cluster_id)
        if caller_cluster != self._cluster_id:
            raise AuthenticationError(
                "impersonation-remote-cluster",
                f"{prefix}: it was authenticated by cluster {caller_cluster}, but this CA only "
                f"knows the pods of cluster {self._cluster_id}",
            )
        if not caller.pod_name or not caller.pod_uid:
            raise AuthenticationError(
                "impersonation-caller-no-pod",
                f"{prefix}: its token is not bound to a pod; node agents must send a projected "
                "(pod-bound) service-account token",
            )
        if not self._pods.synced:
            raise syncing_error(self._pods.progress(), "pod-cache-not-synced", "node impersonation")
        pod = await self._pods.fetch(who.namespace, caller.pod_name)
        if pod is None:
            raise AuthenticationError(
                "impersonation-caller-pod-not-found",
                f"{prefix}: its pod {who.namespace}/{caller.pod_name} does not exist",
            )
        if pod.uid != caller.pod_uid:
            raise AuthenticationError(
                "impersonation-pod-uid-mismatch",
                f"{prefix}: pod {who.namespace}/{caller.pod_name} has uid {pod.uid}, but the "
                f"token was issued for uid {caller.pod_uid} (a deleted pod of the same name)",
            )
        if pod.service_account != who.service_account:
            raise AuthenticationError(
                "impersonation-caller-pod-account-mismatch",
                f"{prefix}: pod {who.namespace}/{caller.pod_name} runs as service account "
                f"{pod.service_account}, not {who.service_account}",
            )
        if pod.node_name is None:
            raise AuthenticationError(
                "impersonation-caller-pod-unscheduled",
                f"{prefix}: its pod {who.namespace}/{caller.pod_name} is not scheduled on a node",
            )
        if target.trust_domain != self._trust_domain:
            raise AuthenticationError(
                "impersonation-trust-domain",
                f"{prefix}: this CA issues identities in trust domain {self._trust_domain}",
            )
        on_node = self._pods.fetch_runs_on_node
        if not await on_node(pod.node_name, target.namespace, target.service_account):
            raise AuthenticationError(
                "impersonation-no-target-pod-on-node",
                f"{prefix}: no live pod of service account "
                f"{target.namespace}/{target.service_account} is scheduled on node "
                f"{pod.node_name}",
            )
