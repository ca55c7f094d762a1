"""What a meshca agent tells the CA on every CSR, so the CA can count how far a new trust
bundle has spread before it activates or drops an authority (docs/reference.md#ca-api).

Three gRPC request headers, beside `authorization`:

- `x-meshca-trust-bundle-sha256`: the canonical digest of the trust bundle the agent serves
  (`agent.trust_bundle.bundle_digest`: SHA-256 over the sorted SHA-256 digests of the roots'
  DER); absent before the agent holds any bundle.
- `x-meshca-leaf-authority`: the Subject Key ID (lower-case hex) of the authority that signed the
  leaf being renewed, read from that leaf's Authority Key Identifier; absent for a first
  certificate (nothing is renewed) or a leaf without that extension.
- `x-meshca-agent-id`: stable for one run of the agent process: the pod or node name plus a
  random suffix, so the CA counts agents, not requests, and a restarted agent counts anew.

Istio's agents send none of these; the CA treats such callers as "unknown" and serves them
as before. Pure: the caller hands in the leaf and the current digest.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509

from certs import issuer_key_id
from meshca.wire import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER

AGENT_ID_SUFFIX_BYTES = 4


def new_agent_id(name: str | None, rng: random.Random | None = None) -> str:
    """`<name>-<8 hex digits>`; `name` defaults to the host name (a pod's name in Kubernetes)."""
    base = (name or socket.gethostname() or "agent").strip()
    suffix = (rng or random.SystemRandom()).getrandbits(8 * AGENT_ID_SUFFIX_BYTES)
    return f"{base}-{suffix:0{2 * AGENT_ID_SUFFIX_BYTES}x}"


def leaf_authority(leaf: x509.Certificate) -> str | None:
    """The signing authority's Subject Key ID in hex, from the leaf's Authority Key Identifier."""
    return issuer_key_id(leaf)


@dataclass(frozen=True)
class AgentReport:
    """The periodic report's content (`agent.reporter`): the CSR headers' facts for every
    identity at once."""

    agent_id: str
    bundle_digest: str | None
    leaf_authorities: frozenset[str]
    # The kids of the JWT bundle the agent holds, in the bundle's order (none: it holds none).
    jwt_kids: tuple[str, ...] = ()


@dataclass(frozen=True)
class PropagationReport:
    """Builds the headers for one CSR from the agent's id and its current bundle digest."""

    agent_id: str
    bundle_digest: Callable[[], str | None]

    def periodic(
        self, leaf_authorities: frozenset[str], jwt_kids: tuple[str, ...] = ()
    ) -> AgentReport:
        return AgentReport(self.agent_id, self.bundle_digest(), leaf_authorities, jwt_kids)

    def headers(self, authority: str | None) -> tuple[tuple[str, str], ...]:
        headers = [(AGENT_ID_HEADER, self.agent_id)]
        digest = self.bundle_digest()
        if digest:
            headers.append((TRUST_BUNDLE_HEADER, digest))
        if authority:
            headers.append((LEAF_AUTHORITY_HEADER, authority))
        return tuple(headers)
