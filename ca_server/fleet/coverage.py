"""Which authorities the fleet trusts and serves, from the agents' bundle digests — the figure
that says how far a new root has spread, and the one the activation gate waits for.

Coverage rule (`authority_coverage`): a digest says nothing by itself about which roots it
covers, so the reader computes the digest of every non-empty subset of the authorities in the
shared state (there are at most a handful: `subset_digests`) and an agent trusts authority X
exactly when its digest is that of a subset containing X. An agent whose digest matches no
subset (a bundle holding roots the CA no longer knows, or none yet) is *reporting* and trusts
none of them: it is never counted as covered by guesswork. What the reader could not see —
entries a process cut to fit its published object or evicted (`unseen`), a snapshot it could not
read (`unreadable`) — counts as *not trusting* for activation and as *maybe serving* for revoke,
and every figure says how much that is.

JWT keys (`jwt_coverage`): agents report the `kid`s of the JWT bundle they hold directly (a
handful, each an RFC 7638 thumbprint), so no subset digests are needed: an agent holds kid X
exactly when its report names X. An agent that holds no JWT bundle (none of its workloads made a
JWT call: it fetches the current bundle, prepared key included, at the first one) has nothing
to strand and is not counted; one that holds a bundle without X is reporting and does not hold
it; unseen and unreadable count as for roots.

The gate's figure (`gate_coverage` -> `AgentCoverage`) is what the self-signed activation gate
and the plugged-in guard both ask; `AgentCoverage.reaches` is its rule (covered when nothing
is known to be stranded, or when the fraction asked for trusts the new authority). When to give
up waiting (`gate_deadline`, `gate_verdict`) is the authority's decision
(`ca_server.authority.slots`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography import x509

from ca_server.fleet.entries import FleetReports
from certs.bundle import bundle_digest

_MAX_SUBSET_AUTHORITIES = 10  # 1023 digests; the state never holds that many slots


@dataclass(frozen=True)
class Coverage:
    trusting: dict[str, int]  # authority ID -> agents whose bundle holds it
    reporting: int  # pods with a report (and not expired)
    unknown: int  # identities that proved no instance or sent no report (Istio's agents)
    dropped: int = 0  # reports a CA process cut or evicted: unseen, counted as not trusting
    # authority ID -> agents serving at least one leaf it signed (what `revoke` would break)
    serving: dict[str, int] = field(default_factory=dict)
    unreadable: int = 0  # snapshots that could not be read: no figure is complete

    @property
    def unseen(self) -> int:
        return self.dropped


@dataclass(frozen=True)
class AgentCoverage:
    """For the activation gate (and the plugged-in guard): agents whose bundle holds the new
    authority, agents that reported, and what could not be seen — reports a CA process cut or
    evicted (`unseen`) and snapshots that could not be read (`unreadable`). Conservative by
    construction: an unseen agent counts as not trusting, and an unreadable snapshot (how many
    agents it holds, nobody knows) holds the decision until it can be read or the deadline."""

    trusting: int
    reporting: int
    unseen: int = 0
    unreadable: int = 0

    def reaches(self, fraction: float) -> bool:
        """Covered when nothing is known to be stranded (no agent reports, nothing unseen or
        unreadable) or when `fraction` of the reporting and unseen agents trust it."""
        if self.unreadable:
            return False
        counted = self.reporting + self.unseen
        return counted == 0 or self.trusting >= fraction * counted

    def __str__(self) -> str:
        return self.said("trust")

    def said(self, verb: str) -> str:
        """The figure in words: `verb` is what a covered agent does with the new authority
        ("trust" a root, "hold" a JWT key)."""
        blind = ""
        if self.unseen:
            blind += f", {self.unseen} unseen counted as not {verb}ing"
        if self.unreadable:
            blind += f", {self.unreadable} report(s) unreadable"
        if self.reporting + self.unseen == 0:
            return f"no agent reports{blind}"
        return f"{self.trusting}/{self.reporting + self.unseen} reporting agents {verb} it{blind}"


def subset_digests(
    authorities: Sequence[tuple[str, x509.Certificate]],
) -> dict[str, frozenset[str]]:
    """The digest of every non-empty subset of `authorities` -> the IDs in it."""
    by_digest: dict[str, frozenset[str]] = {}
    known = list(authorities)[:_MAX_SUBSET_AUTHORITIES]
    for size in range(1, len(known) + 1):
        for subset in itertools.combinations(known, size):
            by_digest[bundle_digest(cert for _id, cert in subset)] = frozenset(
                i for i, _c in subset
            )
    return by_digest


def gate_coverage(
    authorities: Sequence[tuple[str, x509.Certificate]], fleet: FleetReports, ident: str
) -> AgentCoverage:
    """The activation gate's figure for authority `ident` among `authorities` (what the self-
    signed gate and the plugged-in guard both ask, from every CA process's reports)."""
    counted = authority_coverage(authorities, fleet)
    return AgentCoverage(
        counted.trusting.get(ident, 0), counted.reporting, counted.unseen, counted.unreadable
    )


def authority_coverage(
    authorities: Sequence[tuple[str, x509.Certificate]], fleet: FleetReports
) -> Coverage:
    """Applies the module's rule: `authorities` are (ID, root certificate) of every slot."""
    by_digest = subset_digests(authorities)
    trusting = dict.fromkeys((ident for ident, _cert in authorities), 0)
    serving = dict.fromkeys((ident for ident, _cert in authorities), 0)
    for entry in fleet.entries.values():
        for ident in by_digest.get(entry.bundle or "", frozenset()):
            trusting[ident] += 1
        for ident in entry.leaves & serving.keys():
            serving[ident] += 1
    return Coverage(
        trusting,
        len(fleet.entries),
        len(fleet.unknown),
        fleet.dropped,
        serving,
        fleet.unreadable,
    )


def jwt_coverage(kid: str, fleet: FleetReports) -> AgentCoverage:
    """The JWT key activation gate's figure for `kid` (the module's JWT rule): `trusting` is
    the agents whose JWT bundle holds it, `reporting` those that hold any JWT bundle."""
    holding = reporting = 0
    for entry in fleet.entries.values():
        if entry.jwt_keys:
            reporting += 1
            holding += kid in entry.jwt_keys
    return AgentCoverage(holding, reporting, fleet.dropped, fleet.unreadable)
