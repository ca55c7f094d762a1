"""PKI views for the `certs` unit tests (and the signer's in tests/ca_server): the keys and
certificates themselves, so those tests can call `certs` functions directly on them (built by
`tests.support.pki.TestCa`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509

from certs import PrivateKey, SpiffeId, build_workload_certificate, generate_private_key
from tests.support.pki import TestCa

NOW = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)
TRUST_DOMAIN = "cluster.local"
IDENTITY = SpiffeId(TRUST_DOMAIN, "default", "httpbin")


@dataclass(frozen=True)
class Pki:
    root_key: PrivateKey
    root: x509.Certificate
    intermediate_key: PrivateKey
    intermediate: x509.Certificate
    leaf_key: PrivateKey


def make_leaf(
    pki: Pki,
    *,
    issuer: x509.Certificate | None = None,
    issuer_key: PrivateKey | None = None,
    not_before: datetime = NOW - timedelta(minutes=2),
    not_after: datetime = NOW + timedelta(hours=24),
) -> x509.Certificate:
    return build_workload_certificate(
        pki.leaf_key.public_key(),
        IDENTITY,
        issuer if issuer is not None else pki.intermediate,
        issuer_key if issuer_key is not None else pki.intermediate_key,
        not_before=not_before,
        not_after=not_after,
    )


def make_pki() -> Pki:
    """A root and an intermediate under it (both valid around `NOW`), plus a leaf key, from the
    suite's one test PKI (`tests.support.pki.TestCa`). ECDSA P-256 throughout: fast to generate.
    """
    root = TestCa(NOW - timedelta(days=1), trust_domain=TRUST_DOMAIN)
    intermediate = root.child_ca(lifetime=timedelta(days=365))
    return Pki(root.key, root.cert, intermediate.key, intermediate.cert, generate_private_key())
