"""Signing workload certificates with the CA's current authority.

`Signer` is the seam for what comes later (a signer per core sharing one root, a remote/HSM
signer, rotation): the service only asks it to `sign` and for the current `authority`.
Swapping the authority (plugged-in CA changed, rotation) is atomic from the service's view: each
request signs with the authority it read once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cryptography import x509

from ca_server.ttl import Validity
from certs import PublicKey, SigningAuthority, SpiffeId


@dataclass(frozen=True)
class IssuedCertificate:
    leaf: x509.Certificate
    cert_chain: list[str]  # Istio's response layout: leaf, intermediates, root bundle


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


class LocalSigner:
    """Signs in-process with a key held in memory."""

    def __init__(self, authority: SigningAuthority) -> None:
        self._authority = authority

    @property
    def authority(self) -> SigningAuthority:
        return self._authority

    def replace(self, authority: SigningAuthority) -> None:
        self._authority = authority

    @property
    def trusted_client_roots(self) -> tuple[x509.Certificate, ...]:
        """Anchors a client certificate (renewal over mTLS) may chain to."""
        return self._authority.roots

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
        re-encoding of an EC key. Loaded back once because callers read the leaf's fields."""
        authority = self._authority
        der = authority.leaf_template.sign(
            public_key,
            identity,
            not_before=validity.not_before,
            not_after=validity.not_after,
            csr=csr,
        )
        leaf = x509.load_der_x509_certificate(der)
        return IssuedCertificate(leaf=leaf, cert_chain=authority.response_chain(leaf))
