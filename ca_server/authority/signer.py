"""The one signer: signs workload certificates with the CA's current authority and records
each leaf in the leaf ledger under the authority it counts under.

`Signer` is the seam for what comes later (a signer per core sharing one root, a remote/HSM
signer): the service only asks it to `sign` and for the current `authority`. The driver
(`ca_server.authority`) keeps it current with `use`: the authority to sign with, the ID each
leaf counts under in the ledger (the active slot for self-signed authorities; the root the
signing chain ends at for a plugged-in CA), the roots a client certificate may chain to, and
the tainted authorities (so a client certificate one of them signed is refused by name).
`replace` is `use` for material that carries no slot state (a plugged-in CA). They travel
together as one value, so each request reads them once: a swap is atomic from the service's
view.

Concurrency: `sign` runs on the event loop (or a test's thread) and reads the current value
once per request; `use` replaces it in one assignment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Protocol

from cryptography import x509

from ca_server.authority.slots import authority_id
from ca_server.fleet import LeafLedger
from ca_server.ttl import Validity
from certs import PublicKey, SigningAuthority, SpiffeId, der_to_pem, random_serial
from certs.chain import issued_by
from meshca.clock import Clock, SystemClock


@dataclass(frozen=True)
class IssuedCertificate:
    """A signed leaf, with what the CA's request path reads of it known from the signing
    itself (the serial it chose, the notAfter it encoded, its authority's key id), so the
    leaf is parsed only by a caller that asks for `leaf`."""

    der: bytes
    serial: int
    not_after: datetime  # as the leaf holds it: UTC, whole seconds
    issuer_key_id: str | None  # `certs.issuer_key_id(leaf)`: the authority's
    cert_chain: list[str]  # Istio's response layout: leaf, intermediates, root bundle

    @cached_property
    def leaf(self) -> x509.Certificate:
        return x509.load_der_x509_certificate(self.der)


class Signer(Protocol):
    @property
    def authority(self) -> SigningAuthority: ...

    def sign(
        self,
        public_key: PublicKey,
        identity: SpiffeId,
        validity: Validity,
        *,
        csr: x509.CertificateSigningRequest | None = None,
    ) -> IssuedCertificate: ...


def anchor_of(authority: SigningAuthority) -> x509.Certificate | None:
    """The root the signing chain ends at (what a leaf from this authority verifies to)."""
    top = (authority.cert, *authority.intermediates)[-1]
    for root in authority.roots:
        if root == top or issued_by(top, root):
            return root
    return None


def anchor_id(authority: SigningAuthority) -> str | None:
    """The ledger ID a plugged-in CA's leaves count under: their root's (found once per
    authority, it may take signature checks, not per leaf)."""
    anchor = anchor_of(authority)
    return authority_id(anchor) if anchor is not None else None


@dataclass(frozen=True)
class _Signing:
    authority: SigningAuthority
    counts_under: str | None  # the ledger ID of each leaf; `None`: not counted
    client_roots: tuple[x509.Certificate, ...]
    tainted_since: Mapping[str, datetime] = field(default_factory=dict)  # authority ID -> when


class LocalSigner:
    """Signs in-process with a key held in memory; records each leaf in `ledger`."""

    def __init__(
        self,
        authority: SigningAuthority,
        ledger: LeafLedger | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.ledger = ledger if ledger is not None else LeafLedger()
        self._clock = clock or SystemClock()
        self._signing = _Signing(authority, anchor_id(authority), authority.roots)

    @property
    def authority(self) -> SigningAuthority:
        return self._signing.authority

    @property
    def counts_under(self) -> str | None:
        """The ledger ID the next leaf is recorded under."""
        return self._signing.counts_under

    @property
    def trusted_client_roots(self) -> tuple[x509.Certificate, ...]:
        """Anchors a client certificate (renewal over mTLS) may chain to: for self-signed
        slots the bundle without tainted roots."""
        return self._signing.client_roots

    @property
    def tainted_authorities(self) -> Mapping[str, datetime]:
        """When each tainted authority (by ID) was tainted: why a client certificate one of
        them signed no longer chains to `trusted_client_roots`."""
        return self._signing.tainted_since

    def use(
        self,
        authority: SigningAuthority,
        counts_under: str | None,
        client_roots: tuple[x509.Certificate, ...],
        tainted_since: Mapping[str, datetime] | None = None,
    ) -> None:
        self._signing = _Signing(authority, counts_under, client_roots, dict(tainted_since or {}))

    def replace(self, authority: SigningAuthority) -> None:
        """Signs with `authority` from now on, counting leaves under its root."""
        self.use(authority, anchor_id(authority), authority.roots)

    def sign(
        self,
        public_key: PublicKey,
        identity: SpiffeId,
        validity: Validity,
        *,
        csr: x509.CertificateSigningRequest | None = None,
    ) -> IssuedCertificate:
        """The leaf from the authority's DER template (`certs.leaf_template`: byte for byte the
        builder's TBSCertificate); `csr`, the verified CSR the key was read from, spares the
        re-encoding of an EC key. Not parsed back: what callers read of the leaf is known here."""
        signing = self._signing
        authority = signing.authority
        end = validity.not_after  # a naive time is taken as UTC, as the template does
        end = end.replace(tzinfo=UTC) if end.tzinfo is None else end.astimezone(UTC)
        # The TTL was clamped to the authority the caller saw; with handlers running off the
        # event loop (`ca_server.serving.cq_server`) a reload may swap it before this line, and
        # no leaf may outlive the chain that signs it.
        end = min(end, authority.not_after)
        serial = random_serial()
        der = authority.leaf_template.sign(
            public_key,
            identity,
            not_before=validity.not_before,
            not_after=end,
            serial=serial,
            csr=csr,
        )
        # What the template encoded (whole seconds, UTC): the leaf's `not_valid_after_utc`.
        not_after = end.replace(microsecond=0)
        if signing.counts_under is not None:
            self.ledger.record(signing.counts_under, not_after, self._clock.now())
        return IssuedCertificate(
            der=der,
            serial=serial,
            not_after=not_after,
            issuer_key_id=authority.leaf_issuer_key_id,
            cert_chain=authority.response_chain_pem(der_to_pem(der)),
        )
