"""Who is calling the node agent's Workload API: peer credentials → process → pod → identity.

A node agent's socket is shared by every pod on the node, so what a caller gets must follow from
what the kernel says about it, never from anything it sends (the request has no fields, and
metadata is the caller's to forge). SPIRE's Kubernetes workload attestor's way:

1. the kernel's peer credentials of the connection (`SO_PEERCRED`: pid, uid, gid) and, where it
   has one, a pidfd on the connecting process (`SO_PEERPIDFD`), taken by `agent.workload.relay`
   the moment the connection is accepted (`agent.workload.peer_process.take_peer_process`);
2. the pid's cgroup (`/proc/<pid>/cgroup`), read at that same moment and proven to be the
   connecting process's, not that of a process that took its pid after it exited
   (`agent.workload.peer_process.CallerProc`: the pidfd still running, or the start time before the
   accept and unchanged); a pid that is reused later cannot change the answer. The kubelet
   puts every container of a pod under a cgroup named for the pod's UID (`.../pod<uid>/
   <container>` with cgroupfs, `...-pod<uid_with_underscores>.slice/...` with systemd),
   cgroup v1 and v2 alike;
3. the pod with that UID in the node agent's own pod informer (`PodDirectory`): it must be on
   this node and live; its namespace and service account make the SPIFFE ID, and the SVID is
   the scheduler's certificate for that identity, published under the SPIFFE ID.

Any step that fails raises `CallerNotAttested` with the step in `reason` and a message for the
operator; the Workload API answers PERMISSION_DENIED. A process outside any pod (a host
process, the kubelet) is not placed: the node agent serves pods only; nor is a caller that
cannot be told from a process that took its pid.

Injectable: `ProcessCgroups` reads below any `proc_root` (tests hand in a directory with
`<pid>/cgroup` and `<pid>/stat` files) and `PodDirectory` is a protocol (tests hand in a dict),
so the whole chain runs in tests on real sockets with real peer credentials, without real pods.

Concurrency: `pod_uid_of` is a few reads of procfs files (never blocks on a disk) and a poll of
a pidfd, and runs on the event loop at accept time; `PodDirectory.pod_by_uid` reads the
informer's locked index.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from agent.errors import CallerNotAttested
from agent.scheduler import publish_as_spiffe_id
from agent.workload.peer_process import NO_PEER, Accepted, CallerProc, PeerProcess
from certs import SpiffeId, SpiffeIdError
from meshca.pods import PodInfo

NOT_IN_POD = "not_in_a_pod"
UNKNOWN_POD = "unknown_pod"
POD_ENDED = "pod_not_running"
BAD_IDENTITY = "unusable_identity"

# A pod UID (RFC 4122 text form) after `pod`, with `-` (cgroupfs) or `_` (systemd) separators.
_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?![0-9a-f])"
)
MAX_CGROUP_BYTES = 64 * 1024


def pod_uid_in_cgroup(text: str) -> str | None:
    """The pod UID named in a `/proc/<pid>/cgroup` text, or None if it names none; a text naming
    two different pods is refused (it cannot be one process's)."""
    found = {match.group(1).replace("_", "-") for match in _POD_UID.finditer(text)}
    if len(found) > 1:
        raise CallerNotAttested(
            NOT_IN_POD, f"the caller's cgroups name {len(found)} different pods; refusing to guess"
        )
    return next(iter(found), None)


class ProcessCgroups:
    """Reads a caller's cgroup membership below `proc_root` (normally `/proc`), proven to be
    the connecting process's (`agent.workload.peer_process.CallerProc`)."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc = CallerProc(proc_root)

    def pod_uid_of(self, caller: PeerProcess) -> str:
        """The UID of the pod `caller` runs in; `CallerNotAttested` if it cannot be read, is
        not proven to be the caller's, or is in no pod."""
        raw = self.proc.read(caller, "cgroup", MAX_CGROUP_BYTES)
        uid = pod_uid_in_cgroup(raw.decode("utf-8", "replace"))
        if uid is None:
            raise CallerNotAttested(
                NOT_IN_POD,
                f"the caller (pid {caller.pid}) runs in no Kubernetes pod (its cgroup names "
                "none); the node agent serves identities to pods only",
            )
        return uid


class PodDirectory(Protocol):
    """The node's pods by UID (the node agent's informer: `PodIdentitySource.pod_by_uid`)."""

    def pod_by_uid(self, uid: str) -> PodInfo | None: ...


class NodeAttestor:
    """Places a caller: its pod UID (from `ProcessCgroups`, at accept time) → pod → identity."""

    def __init__(
        self, pods: PodDirectory, trust_domain: str, cgroups: ProcessCgroups | None = None
    ) -> None:
        self.pods = pods
        self.trust_domain = trust_domain
        self.cgroups = cgroups or ProcessCgroups()

    def pod_uid_of(self, caller: PeerProcess) -> str:
        """Step 1-2, at accept time."""
        return self.cgroups.pod_uid_of(caller)

    def identity_of_pod(self, pod_uid: str) -> SpiffeId:
        """Step 3, at call time (the informer may learn of a new pod a moment after it starts)."""
        pod = self.pods.pod_by_uid(pod_uid)
        if pod is None:
            raise CallerNotAttested(
                UNKNOWN_POD,
                f"the caller's pod (uid {pod_uid}) is not among the pods this node agent "
                "watches on its node; if it just started, retry in a moment",
            )
        if not pod.live:
            raise CallerNotAttested(
                POD_ENDED, f"the caller's pod {pod.namespace}/{pod.name} has ended ({pod.phase})"
            )
        try:
            return SpiffeId(self.trust_domain, pod.namespace, pod.service_account)
        except SpiffeIdError as exc:
            raise CallerNotAttested(
                BAD_IDENTITY, f"pod {pod.namespace}/{pod.name}: no usable identity: {exc}"
            ) from None


class AcceptedConnections(Protocol):
    """`agent.workload.relay.PeerRelay`: what was learned about a relayed connection at accept."""

    def accepted(self, peer: str) -> Accepted | None: ...


class NodeCaller:
    """The node agent's `agent.workload.api.CallerResolver`: the caller's SVID is the one of
    the pod its connection was traced to; a connection with no such record is refused."""

    def __init__(self, connections: AcceptedConnections, attestor: NodeAttestor) -> None:
        self.connections = connections
        self.attestor = attestor

    def resource_for(self, peer: str) -> str:
        record = self.connections.accepted(peer)
        if record is None:
            raise CallerNotAttested(
                NO_PEER,
                "this connection did not come through the node agent's Workload API socket "
                "(no peer credentials were taken); connect to --workload-api-socket",
            )
        if record.refusal is not None:
            raise record.refusal
        if record.placed is None:  # pragma: no cover - a record holds one or the other
            raise CallerNotAttested(NO_PEER, "the caller was not placed")
        return publish_as_spiffe_id(self.attestor.identity_of_pod(record.placed))

    def describe(self) -> str:
        return "each caller the SVID of its pod (node agent; SO_PEERCRED -> cgroup -> pod)"
