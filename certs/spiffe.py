"""Kubernetes-style SPIFFE identities: `spiffe://<trust-domain>/ns/<namespace>/sa/<account>`.

This is the only identity shape meshca issues; anything else is refused before signing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from certs.errors import SpiffeIdError

DEFAULT_TRUST_DOMAIN = "cluster.local"

# Matched with fullmatch: `$` would also accept a trailing newline.
# SPIFFE spec: trust domain is lowercase letters, digits, '.', '-', '_'.
_TRUST_DOMAIN = re.compile(r"[a-z0-9._-]{1,255}")
# Kubernetes: namespaces are DNS-1123 labels, service accounts DNS-1123 subdomains.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SERVICE_ACCOUNT = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True, order=True)
class SpiffeId:
    """One workload identity: a trust domain, a namespace and a service account."""

    trust_domain: str
    namespace: str
    service_account: str

    def __post_init__(self) -> None:
        if not _TRUST_DOMAIN.fullmatch(self.trust_domain):
            raise SpiffeIdError(
                f"invalid trust domain {self.trust_domain!r}: use lowercase letters, digits, . - _"
            )
        if not _NAMESPACE.fullmatch(self.namespace):
            raise SpiffeIdError(f"invalid namespace {self.namespace!r}: not a DNS-1123 label")
        if not _SERVICE_ACCOUNT.fullmatch(self.service_account):
            raise SpiffeIdError(
                f"invalid service account {self.service_account!r}: not a DNS-1123 subdomain"
            )

    @property
    def uri(self) -> str:
        return f"spiffe://{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"

    def __str__(self) -> str:
        return self.uri

    @classmethod
    def parse(cls, uri: str) -> SpiffeId:
        """Parses a URI, refusing anything but the `/ns/<ns>/sa/<sa>` path shape."""
        prefix = "spiffe://"
        if not uri.startswith(prefix):
            raise SpiffeIdError(f"{uri!r} is not a SPIFFE ID: it must start with spiffe://")
        trust_domain, _, path = uri[len(prefix) :].partition("/")
        parts = path.split("/")
        if len(parts) != 4 or parts[0] != "ns" or parts[2] != "sa":
            raise SpiffeIdError(
                f"{uri!r} is not a Kubernetes SPIFFE ID: expected spiffe://<td>/ns/<ns>/sa/<sa>"
            )
        return cls(trust_domain, parts[1], parts[3])

    def in_trust_domain(self, trust_domain: str) -> SpiffeId:
        """The same workload named in another trust domain."""
        return SpiffeId(trust_domain, self.namespace, self.service_account)
