"""What both daemons keep of a pod, and the one rule for when a pod still counts.

**A pod counts (is live) until it is terminal — phase `Succeeded` or `Failed` — or deleted.**
Pending and Running pods, and pods whose phase is not reported yet, count: a pod that is about
to start needs its certificate before its containers do, and a pod that finished can never run
again (its replacement is a new pod). The CA's node authorizer uses it to decide whether a node
agent may be issued an identity; the node agent uses it to decide which identities to serve.
Both watch pods through `meshca.informer` with `pod_info` as the transform, indexed by node.

The CA's cache also keeps the signer names of a pod's `podCertificate` projected volumes: the
Pod Certificate signer (`ca_server.kube.pod_certificates`) issues only to a pod that mounts one
for it. Most pods mount none and share one empty tuple; the tuples of those that do are shared
too (a cluster uses few signers), so the field costs a pointer per pod.
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
    # The signers of the pod's `podCertificate` projected volumes (the CA's cache only).
    pod_certificate_signers: tuple[str, ...] = ()

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
    signers = pod_certificate_signers(spec)
    return PodInfo(
        namespace=sys.intern(namespace),
        name=name,
        uid=str(metadata.get("uid") or ""),
        service_account=sys.intern(str(account)),
        node_name=sys.intern(str(node)) if node else None,
        phase=sys.intern(str(phase)) if phase else None,
        pod_certificate_signers=signers,
    )


_NO_SIGNERS: tuple[str, ...] = ()
# Shared tuples of signer names, bounded: a pod author chooses the names, so past the bound a
# pod keeps its own tuple rather than growing this table.
_SHARED_SIGNERS: dict[tuple[str, ...], tuple[str, ...]] = {}
_MAX_SHARED_SIGNERS = 1024


def pod_certificate_signers(spec: dict[str, Any]) -> tuple[str, ...]:
    """The signer names of `spec`'s `podCertificate` projected volume sources (a raw pod
    spec), in order without repeats, as the API server's NodeRestriction reads them."""
    names: list[str] = []
    for volume in spec.get("volumes") or ():
        projected = volume.get("projected") if isinstance(volume, dict) else None
        if not isinstance(projected, dict):
            continue
        for source in projected.get("sources") or ():
            certificate = source.get("podCertificate") if isinstance(source, dict) else None
            signer = certificate.get("signerName") if isinstance(certificate, dict) else None
            if isinstance(signer, str) and signer and signer not in names:
                names.append(signer)
    return shared_signers(names)


def shared_signers(names: list[str]) -> tuple[str, ...]:
    """`names` as the shared tuple of interned strings (the empty one when there are none)."""
    if not names:
        return _NO_SIGNERS
    key = tuple(sys.intern(str(name)) for name in names)
    shared = _SHARED_SIGNERS.get(key)
    if shared is not None:
        return shared
    if len(_SHARED_SIGNERS) < _MAX_SHARED_SIGNERS:
        _SHARED_SIGNERS[key] = key
    return key


def node_of(pod: PodInfo) -> str | None:
    """The `BY_NODE` indexer."""
    return pod.node_name


def uid_of(pod: PodInfo) -> str | None:
    """The `BY_UID` indexer."""
    return pod.uid or None
