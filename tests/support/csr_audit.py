"""The CSRs a CA signed, read back from its audit lines, and which of them were renewals due.

Why: "a bundle change causes no re-minting" is a claim about the *timing* of CSRs. An agent
renews a leaf when about half of its life has passed (`agent.rotation`, ratio 0.5 ± 0.01), so a
CSR sent while the identity's previous leaf was still young is an extra one: something other
than ageing (a bundle change, a restart, a taint) made the agent re-sign. Counting the CA's
`issued` audit lines per identity and splitting them that way gives "CSRs = first + due
renewals + extras" for any stretch of time, whatever the leaf TTLs were.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise

# A renewal sent when less than this share of the previous leaf's life had passed is an extra:
# well below the agent's 0.49 minimum, well above anything a bundle push could wait for.
DUE_FRACTION = 0.4


@dataclass(frozen=True)
class Issued:
    """One `issued` audit line of the CA."""

    at: datetime
    identity: str
    serial: str
    ttl_seconds: int


@dataclass
class CsrTally:
    """One identity's CSRs over a stretch of time, split into first, due renewals and early
    ones. `held` is the leaf it held when the stretch began (None: it started within)."""

    identity: str
    held: Issued | None = None
    issued: list[Issued] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.issued)

    @property
    def early(self) -> list[Issued]:
        """Renewals sent while the previous leaf was younger than `DUE_FRACTION` of its life."""
        sequence = ([self.held] if self.held else []) + self.issued
        return [
            current
            for previous, current in pairwise(sequence)
            if (current.at - previous.at).total_seconds() < DUE_FRACTION * previous.ttl_seconds
        ]

    @property
    def due(self) -> int:
        """Renewals sent because the previous leaf had aged (the first leaf is not one)."""
        first = 0 if self.held else min(self.total, 1)
        return self.total - first - len(self.early)


def issued_lines(log: str) -> list[Issued]:
    """Every `issued` audit line in a CA's output, in order."""
    out = []
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") != "issued":
            continue
        out.append(
            Issued(
                datetime.fromisoformat(record["ts"]),
                record["identity"],
                record["serial"],
                int(record["granted_ttl_seconds"]),
            )
        )
    return out


def tally(issued: Iterable[Issued], since: datetime | None = None) -> dict[str, CsrTally]:
    """Per identity, the CSRs signed at or after `since`, each judged against the one before
    (for the first in the stretch, the leaf the identity held when it began)."""
    by_identity: dict[str, CsrTally] = {}
    for item in issued:
        entry = by_identity.setdefault(item.identity, CsrTally(item.identity))
        if since is not None and item.at < since:
            entry.held = item
        else:
            entry.issued.append(item)
    return by_identity
