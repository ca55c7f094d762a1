"""A throwaway mesh PKI for tests, built with meshca's own `certs` library."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cryptography import x509

from agent.secrets import DEFAULT_RESOURCE, ROOT_RESOURCE, RootSecret, TlsSecret
from certs import (
    CLOCK_SKEW_BACKDATE,
    PrivateKey,
    SpiffeId,
    build_root_certificate,
    build_workload_certificate,
    cert_to_pem,
    generate_private_key,
    private_key_to_pem,
)


@dataclass(frozen=True)
class Issued:
    """One workload certificate and its key, as PEM."""

    cert: x509.Certificate
    cert_pem: str
    key_pem: str = field(repr=False)

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    def tls_secret(self, name: str = DEFAULT_RESOURCE) -> TlsSecret:
        return TlsSecret(name=name, cert_chain_pem=self.cert_pem, private_key_pem=self.key_pem)


class TestAuthority:
    """A self-signed root issuing SPIFFE workload certificates directly."""

    __test__ = False  # not a pytest class

    def __init__(self, trust_domain: str = "cluster.local", now: datetime | None = None) -> None:
        self.trust_domain = trust_domain
        self.now = now or datetime.now(UTC)
        self.key: PrivateKey = generate_private_key()
        self.cert = build_root_certificate(
            self.key, trust_domain, now=self.now, lifetime=timedelta(days=1)
        )
        self.root_pem = cert_to_pem(self.cert)

    def root_secret(self, name: str = ROOT_RESOURCE) -> RootSecret:
        return RootSecret(name=name, trusted_ca_pem=self.root_pem)

    def identity(self, service_account: str, namespace: str = "default") -> SpiffeId:
        return SpiffeId(self.trust_domain, namespace, service_account)

    def issue(
        self,
        service_account: str,
        *,
        ttl: timedelta = timedelta(hours=1),
        now: datetime | None = None,
        key: PrivateKey | None = None,
    ) -> Issued:
        now = now or self.now
        key = key or generate_private_key()
        cert = build_workload_certificate(
            key.public_key(),
            self.identity(service_account),
            self.cert,
            self.key,
            not_before=now - CLOCK_SKEW_BACKDATE,
            not_after=now + ttl,
        )
        return Issued(cert, cert_to_pem(cert), private_key_to_pem(key).decode())
