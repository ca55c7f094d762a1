"""The CA's `/debug/ca` document for `meshca status`: its signing material, its authority slots
with coverage (`ca_server.authority.report`; absent — `null` — for a plugged-in CA, whose
authorities the operator rotates through `--cacerts-dir`), and the soonest-expiring leaves.

Rates (issuance, refusals by reason) are not repeated here: `meshca status` reads them from
`/metrics`, the same counters Prometheus scrapes, so the two views cannot disagree.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from cryptography import x509

from ca_server.fleet import IssuedLeaves

SOONEST_LEAVES = 10
SLOT_KEYS = ("authorities", "agents_unknown", "coverage", "agents")  # `status_section`'s keys


class SigningChain(Protocol):
    """The public half of a signing authority, all `/debug/ca` shows of it: a worker's
    `SigningAuthority`, or the chain a worker published for its supervisor
    (`ca_server.serving.worker_status.PublishedChain`), which has no key."""

    @property
    def cert(self) -> x509.Certificate: ...

    @property
    def intermediates(self) -> tuple[x509.Certificate, ...]: ...

    @property
    def roots(self) -> tuple[x509.Certificate, ...]: ...

    @property
    def not_after(self) -> datetime: ...


def _certificate_entry(role: str, cert: x509.Certificate, now: datetime) -> dict[str, Any]:
    return {
        "role": role,
        "subject": cert.subject.rfc4514_string(),
        "serial": f"{cert.serial_number:x}",
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "time_left_seconds": (cert.not_valid_after_utc - now).total_seconds(),
    }


def ca_document(
    authority: SigningChain,
    leaves: IssuedLeaves,
    started: datetime,
    now: datetime,
    slots: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What `meshca status` shows for a CA: each certificate of the signing chain and bundle,
    the chain's expiry (the latest NotAfter a leaf may get), the authority slots (`slots`: an
    `authority.report.status_section`, or `None` without slots), and the soonest-expiring
    leaves."""
    certificates = [_certificate_entry("signing", authority.cert, now)]
    certificates += [_certificate_entry("intermediate", c, now) for c in authority.intermediates]
    certificates += [
        _certificate_entry("root", c, now) for c in authority.roots if c != authority.cert
    ]
    return {
        "kind": "ca",
        "now": now.isoformat(),
        "started": started.isoformat(),
        "chain_not_after": authority.not_after.isoformat(),
        "root_not_after": min(r.not_valid_after_utc for r in authority.roots).isoformat(),
        "certificates": certificates,
        **(slots if slots is not None else dict.fromkeys(SLOT_KEYS)),
        "leaves_known": len(leaves),
        "soonest_expiring_leaves": [
            {
                "identity": leaf.identity,
                "serial": leaf.serial_hex,
                "issued_at": leaf.issued_at.isoformat(),
                "not_after": leaf.not_after.isoformat(),
                "time_left_seconds": (leaf.not_after - now).total_seconds(),
            }
            for leaf in leaves.soonest_expiring(now, SOONEST_LEAVES)
        ],
    }
