"""What the certificate pipeline passes: a `SigningRequest` in, a `SignedCertificate` out.

The scheduler (`agent.scheduler`) builds a `SigningRequest` per fetch and hands it to a
`CertificateSigner`; the one in use is `agent.ca_client.CaClient` (the gRPC transport), tests
use fakes. The answer, a `SignedCertificate`, has already passed `agent.acceptance`; the same
shape comes back from a previous run's files (`agent.cert_state`) and is what the scheduler
keeps per identity. Pure data: no I/O, no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from cryptography import x509

from certs import PrivateKey, SpiffeId

__all__ = ["CertificateSigner", "SignedCertificate", "SigningRequest"]


@dataclass(frozen=True)
class SigningRequest:
    """One CSR to have signed: what the scheduler hands any signer (`CaClient`, test fakes)."""

    csr_pem: str
    identity: SpiffeId  # the answer must name exactly this
    key: PrivateKey = field(repr=False)  # ... and certify this key (never sent)
    ttl: timedelta
    impersonate: SpiffeId | None = None  # node mode: ask on behalf of this workload identity
    renewal: bool = False  # the caller still holds a valid certificate for `identity`
    leaf_authority: str | None = None  # SKI hex of the issuer of the leaf being renewed


@dataclass(frozen=True)
class SignedCertificate:
    """A validated certificate, with the time it arrived (rotation is measured from then, not
    from the backdated NotBefore)."""

    chain_pem: str  # leaf first, then intermediates
    root_bundle_pem: str
    leaf: x509.Certificate
    received_at: datetime

    @property
    def not_after(self) -> datetime:
        return self.leaf.not_valid_after_utc

    @property
    def serial_hex(self) -> str:
        return format(self.leaf.serial_number, "x")


class CertificateSigner(Protocol):
    """What the scheduler needs from a CA client (`agent.ca_client.CaClient`, or a test fake)."""

    async def sign(self, request: SigningRequest) -> SignedCertificate: ...
