"""Signing material of a CA: the issuing certificate, its key, the path to the root, the roots.

Both a self-signed root (issuing cert == root) and a plugged-in intermediate are described by
the same `SigningAuthority`; it validates itself once on load so a broken plugged-in CA refuses
to start instead of issuing chains nobody can verify.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property

from cryptography import x509

from certs.chain import is_ca, issued_by, verify_chain
from certs.errors import ChainError, KeyMaterialError
from certs.keys import KeySpec, PrivateKey, generate_private_key, key_matches_certificate
from certs.leaf_template import LeafTemplate
from certs.pem import cert_to_pem, certs_to_pem
from certs.profile import WorkloadLeafProfile, build_root_certificate


@dataclass(frozen=True)
class SigningAuthority:
    """What the CA signs with.

    - `cert`/`key`: the issuing CA certificate and its private key.
    - `intermediates`: certificates between `cert` and a root, nearest first (excluding roots).
    - `roots`: the trust bundle published to workloads (may hold several roots while rotating).

    Immutable, so what is derived from it (expiry bound, PEM of the chain and bundle) is
    computed once per authority rather than once per signed certificate.
    """

    cert: x509.Certificate
    key: PrivateKey = field(repr=False)
    intermediates: tuple[x509.Certificate, ...]
    roots: tuple[x509.Certificate, ...]

    @property
    def is_self_signed_root(self) -> bool:
        return not self.intermediates and self.cert in self.roots

    @cached_property
    def not_after(self) -> datetime:
        """The latest NotAfter a leaf may have: the earliest expiry along the chain to the root.

        The root counts too: a plugged-in intermediate may outlive its root, and a leaf must not
        outlive the root it verifies to. If several roots anchor the chain (rotation), the one
        that lasts longest bounds it. Cached: asked on every request, and with several roots of
        one name in the bundle (rotation) finding the anchors costs signature checks.
        """
        chain_certs = [self.cert, *self.intermediates]
        expiries = [cert.not_valid_after_utc for cert in chain_certs]
        top = chain_certs[-1]
        anchors = [root for root in self.roots if root == top or issued_by(top, root)]
        if anchors:
            expiries.append(max(root.not_valid_after_utc for root in anchors))
        return min(expiries)

    def validate(self, *, now: datetime) -> None:
        """Refuses unusable material with a message naming the fault."""
        if not key_matches_certificate(self.key, self.cert):
            raise KeyMaterialError("the CA private key does not match the CA certificate")
        if not is_ca(self.cert):
            raise ChainError("the CA certificate is not a CA (BasicConstraints CA:true missing)")
        try:
            verify_chain([self.cert, *self.intermediates], self.roots, now=now)
        except ChainError as exc:
            raise ChainError(
                f"the CA certificate does not chain to the root bundle: {exc}"
            ) from exc

    @cached_property
    def leaf_profile(self) -> WorkloadLeafProfile:
        """The workload leaf profile of this issuer, derived once per authority."""
        return WorkloadLeafProfile.for_issuer(self.cert, self.key)

    @cached_property
    def leaf_template(self) -> LeafTemplate:
        """The same profile as DER pieces (`certs.leaf_template`), encoded once per authority:
        what the CA signs every workload leaf with."""
        return LeafTemplate.from_profile(self.leaf_profile)

    def response_chain(self, leaf: x509.Certificate) -> list[str]:
        """Istio's `cert_chain` layout: leaf, each CA cert up to the root, then the root bundle.

        For a self-signed root the issuing cert *is* the root and appears only in the bundle.
        """
        return self.response_chain_pem(cert_to_pem(leaf))

    def response_chain_pem(self, leaf_pem: str) -> list[str]:
        """`response_chain` for a leaf already in PEM."""
        return [leaf_pem, *self._ca_chain_pems, self.root_bundle_pem]

    @cached_property
    def leaf_issuer_key_id(self) -> str | None:
        """`issuer_key_id` of every leaf this authority signs: the key identifier its profile
        writes in the leaves' Authority Key Identifier, in hex."""
        key_id = self.leaf_profile.authority_key_id.key_identifier
        return key_id.hex() if key_id else None

    @cached_property
    def _ca_chain_pems(self) -> tuple[str, ...]:
        return tuple(map(cert_to_pem, self.ca_chain))

    @cached_property
    def ca_chain(self) -> tuple[x509.Certificate, ...]:
        """The CA certificates from the issuer up to (not including) the roots: what a leaf or
        serving certificate presents after itself."""
        return tuple(c for c in (self.cert, *self.intermediates) if c not in self.roots)

    @cached_property
    def root_bundle_pem(self) -> str:
        return certs_to_pem(self.roots)

    @property
    def chain_pem(self) -> str:
        """The issuing certificate followed by its intermediates (`cert-chain.pem`)."""
        return certs_to_pem([self.cert, *self.intermediates])


def make_authority(
    cert: x509.Certificate,
    key: PrivateKey,
    chain: Sequence[x509.Certificate],
    roots: Sequence[x509.Certificate],
) -> SigningAuthority:
    """Builds an authority from an Istio-style `cert-chain.pem` (which may start with `cert` and
    may end with the root), dropping the duplicates so each certificate appears once."""
    intermediates = [c for c in chain if c != cert and c not in roots]
    return SigningAuthority(
        cert=cert, key=key, intermediates=tuple(intermediates), roots=tuple(roots)
    )


def self_signed_authority(cert: x509.Certificate, key: PrivateKey) -> SigningAuthority:
    """A root that signs workloads directly: it is its own issuer and the whole trust bundle."""
    return SigningAuthority(cert=cert, key=key, intermediates=(), roots=(cert,))


def new_self_signed_authority(
    spec: KeySpec, trust_domain: str, *, now: datetime, lifetime: timedelta
) -> SigningAuthority:
    """A freshly generated self-signed root (what a CA without a plugged-in CA starts with)."""
    key = generate_private_key(spec)
    cert = build_root_certificate(key, trust_domain, now=now, lifetime=lifetime)
    return self_signed_authority(cert, key)
