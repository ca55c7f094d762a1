"""May a node agent (ztunnel-style) ask for another workload's identity?

Until the Kubernetes node authorizer exists, impersonation is refused outright
(`DenyImpersonation`). The node authorizer implements the same protocol and is chosen at start-up.
"""

from __future__ import annotations

from typing import Protocol

from ca_server.authn import Caller
from ca_server.errors import AuthenticationError
from certs import SpiffeId


class ImpersonationPolicy(Protocol):
    async def authorize(self, caller: Caller, target: SpiffeId) -> None:
        """Returns if `caller` may be issued `target`'s identity; raises otherwise."""
        ...


class DenyImpersonation:
    async def authorize(self, caller: Caller, target: SpiffeId) -> None:
        raise AuthenticationError(
            "impersonation-disabled",
            f"{caller.identity.uri} asked to impersonate {target.uri}, but this CA has no node "
            "authorizer: impersonation needs Kubernetes mode with CA_TRUSTED_NODE_ACCOUNTS",
        )
