"""The CA's own TLS identity on its gRPC ports, kept in step with the signing authority.

gRPC asks `fetch()` before each handshake (`dynamic_ssl_server_credentials`). When the authority
has changed (plugged-in CA replaced, shared root reloaded) or the serving certificate is past
two thirds of its life, a new serving certificate is issued from the current authority, so
clients that trust the new root can connect without a CA restart.

Threading: `fetch()` runs on gRPC's threads; it reads `signer.authority` (a single reference
read) and swaps its own cached configuration under a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime

import grpc

from ca_server.authority import Signer
from ca_server.config import CaConfig
from certs import (
    SigningAuthority,
    build_serving_certificate,
    cert_to_pem,
    certs_to_pem,
    generate_private_key,
    private_key_to_pem,
)
from meshca.clock import Clock


@dataclass(frozen=True)
class _Issued:
    authority: SigningAuthority
    configuration: grpc.ServerCertificateConfiguration
    renew_at: datetime


class ServingTls:
    def __init__(
        self, config: CaConfig, signer: Signer, clock: Clock, *, require_client_cert: bool
    ) -> None:
        self._config = config
        self._signer = signer
        self._clock = clock
        self._require_client_cert = require_client_cert
        self._lock = threading.Lock()
        self._issued = self._issue(signer.authority)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._issued.configuration,
            self.fetch,
            require_client_authentication=self._require_client_cert,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when one is due, else `None` (gRPC keeps the current one)."""
        authority = self._signer.authority
        with self._lock:
            current = self._issued
            if current.authority is authority and self._clock.now() < current.renew_at:
                return None
            self._issued = self._issue(authority)
            return self._issued.configuration

    def _issue(self, authority: SigningAuthority) -> _Issued:
        now = self._clock.now()
        key = generate_private_key()
        cert = build_serving_certificate(
            key.public_key(),
            authority.cert,
            authority.key,
            hosts=self._config.serving_hosts,
            now=now,
            lifetime=self._config.serving_cert_lifetime,
        )
        chain = cert_to_pem(cert) + certs_to_pem(authority.ca_chain)
        configuration = grpc.ssl_server_certificate_configuration(
            [(private_key_to_pem(key), chain.encode())],
            root_certificates=authority.root_bundle_pem.encode()
            if self._require_client_cert
            else None,
        )
        renew_at = now + (cert.not_valid_after_utc - now) * 2 / 3
        return _Issued(authority, configuration, renew_at)
