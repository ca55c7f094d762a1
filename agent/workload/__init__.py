"""The SPIFFE Workload API: the agent's identities for SPIFFE-aware applications, and, in node
mode, who is asking.

    api.WorkloadApiServer          SpiffeWorkloadAPI on a Unix socket, from the agent's one
                                   `SecretCache`; who is asking is a `CallerResolver`'s business
    ├── api.PodCaller              pod agent: the socket is the pod's, every caller gets its
    │                              one identity
    └── attestor.NodeCaller        node agent: each connection's pod, traced when it was accepted
          relay.PeerRelay          the public socket: takes the connecting process, then relays
                                   to the server's private socket
          peer_process             the connecting process held by a pidfd or its start time
                                   (`PeerCredentials`, `PeerProcess`, the relay's `Accepted`)
          attestor.NodeAttestor    process → cgroup → pod UID → the pod's identity

Modules: `api` (the server, its refusals and metrics; it imports none of the others but
`jwt_profile`: a caller is a `CallerResolver`), `jwt_profile` (FetchJWTSVID, FetchJWTBundles,
ValidateJWTSVID over `agent.jwt_svids`), `attestor` (node mode: peer credentials → cgroup →
pod → identity), `relay` (node mode: the public socket, taking `SO_PEERCRED`), `peer_process`
(node mode: what is read of a pid is the connecting process's own). The relay and the
attestor meet only in `peer_process`'s types, below both; `agent.main` composes them.

This facade exports what both modes use; node mode's parts are imported from their modules
where node mode is composed (`agent.main`), so a pod agent never loads them. Concurrency: all
on the agent's event loop (see each module).
"""

from __future__ import annotations

from agent.workload.api import CallerResolver, PodCaller, WorkloadApiServer

__all__ = ["CallerResolver", "PodCaller", "WorkloadApiServer"]
