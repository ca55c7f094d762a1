"""What both daemons keep of a pod, and the one rule for when a pod still counts.

**A pod counts (is live) until it is terminal — phase `Succeeded` or `Failed` — or deleted.**
Pending and Running pods, and pods whose phase is not reported yet, count: a pod that is about
to start needs its certificate before its containers do, and a pod that finished can never run
again (its replacement is a new pod). The CA's node authorizer uses it to decide whether a node
agent may be issued an identity; the node agent uses it to decide which identities to serve.
Both watch pods through `meshca.informer` with `pod_info` as the transform, indexed by node.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
BY_NODE = "node"  # the informer index: node name -> pods scheduled there
BY_UID = "uid"  # the informer index: pod UID -> that pod (the Workload API's attestor)


@dataclass(frozen=True, slots=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    service_account: str
    node_name: str | None
    phase: str | None

    @property
    def live(self) -> bool:
        """Not terminal (see the module docstring); deleted pods leave the cache altogether."""
        return self.phase not in TERMINAL_PHASES


def pod_info(obj: Any) -> PodInfo:
    """The fields meshca reads from a `V1Pod` (the service account defaults to `default`)."""
    spec, status = obj.spec, obj.status
    return PodInfo(
        namespace=obj.metadata.namespace,
        name=obj.metadata.name,
        uid=obj.metadata.uid or "",
        service_account=(spec.service_account_name if spec else None) or "default",
        node_name=(spec.node_name if spec else None) or None,
        phase=status.phase if status else None,
    )


def pod_info_from_json(obj: dict[str, Any]) -> PodInfo:
    """`pod_info` of a pod as the API server sends it (a raw JSON object), for the CA's
    cluster-wide cache (`meshca.paged_informer`). The strings a cluster repeats — namespace,
    service account, node, phase — are interned, so 150,000 pods share a few thousand of them."""
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise ValueError("a pod without metadata.namespace and metadata.name")
    account = spec.get("serviceAccountName") or "default"
    node = spec.get("nodeName") or None
    phase = status.get("phase") or None
    return PodInfo(
        namespace=sys.intern(namespace),
        name=name,
        uid=str(metadata.get("uid") or ""),
        service_account=sys.intern(str(account)),
        node_name=sys.intern(str(node)) if node else None,
        phase=sys.intern(str(phase)) if phase else None,
    )


def node_of(pod: PodInfo) -> str | None:
    """The `BY_NODE` indexer."""
    return pod.node_name


def uid_of(pod: PodInfo) -> str | None:
    """The `BY_UID` indexer."""
    return pod.uid or None
