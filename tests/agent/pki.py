"""Test PKI and fake CAs for agent tests, built with the project's own `certs` library."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import grpc

from agent.ca_client import SignedCertificate, SigningRequest
from certs import (
    CLOCK_SKEW_BACKDATE,
    PrivateKey,
    SpiffeId,
    build_root_certificate,
    build_serving_certificate,
    build_workload_certificate,
    cert_to_pem,
    certs_to_pem,
    describe_csr,
    generate_private_key,
    load_csr,
    private_key_to_pem,
    public_key_of,
)
from meshca.clock import Clock
from meshca_proto import ca_pb2, ca_pb2_grpc

IDENTITY = SpiffeId("cluster.local", "default", "app")


@dataclass
class Pki:
    """A self-signed root that signs workload leaves the way the CA does."""

    now: datetime
    root_key: PrivateKey = field(default_factory=generate_private_key)

    def __post_init__(self) -> None:
        self.root = build_root_certificate(
            self.root_key, "cluster.local", now=self.now, lifetime=timedelta(days=3650)
        )

    @property
    def root_pem(self) -> str:
        return cert_to_pem(self.root)

    def issue(
        self, csr_pem: str, ttl: timedelta, now: datetime, uri: str | None = None
    ) -> list[str]:
        """Istio's response layout: leaf, then the root bundle."""
        csr = load_csr(csr_pem)
        requested = describe_csr(csr).uri_sans[0]
        leaf = build_workload_certificate(
            public_key_of(csr),
            SpiffeId.parse(uri or requested),
            self.root,
            self.root_key,
            not_before=now - CLOCK_SKEW_BACKDATE,
            not_after=now + ttl,
        )
        return [cert_to_pem(leaf), certs_to_pem([self.root])]

    def write_serving(self, directory: Path, now: datetime) -> tuple[bytes, bytes]:
        """(key PEM, cert PEM) for a CA serving on loopback with the CA's usual names."""
        key = generate_private_key()
        cert = build_serving_certificate(
            key.public_key(),
            self.root,
            self.root_key,
            hosts=["localhost", "127.0.0.1", "istiod.istio-system.svc"],
            now=now,
            lifetime=timedelta(days=1),
        )
        (directory / "root-cert.pem").write_text(self.root_pem)
        return private_key_to_pem(key), cert_to_pem(cert).encode()


class FakeSigner:
    """A `CertificateSigner` that signs with a `Pki`, or raises the queued failures first."""

    def __init__(self, pki: Pki, clock: Clock) -> None:
        self.pki = pki
        self.clock = clock
        self.failures: list[Exception] = []
        self.fail_always: Exception | None = None
        self.calls = 0
        self.impersonated: list[SpiffeId | None] = []

    async def sign(self, request: SigningRequest) -> SignedCertificate:
        from certs import load_cert

        self.calls += 1
        self.impersonated.append(request.impersonate)
        if self.fail_always is not None:
            raise self.fail_always
        if self.failures:
            raise self.failures.pop(0)
        now = self.clock.now()
        elements = self.pki.issue(request.csr_pem, request.ttl, now)
        return SignedCertificate(
            chain_pem=elements[0],
            root_bundle_pem=elements[1],
            leaf=load_cert(elements[0]),
            received_at=now,
        )


Responder = Callable[[ca_pb2.IstioCertificateRequest, grpc.aio.ServicerContext], list[str]]


class FakeCaServicer(ca_pb2_grpc.IstioCertificateServiceServicer):
    """An in-process CA speaking the real gRPC API, recording each call's metadata."""

    def __init__(self, pki: Pki, clock: Clock) -> None:
        self.pki = pki
        self.clock = clock
        self.metadata: list[dict[str, str]] = []
        self.abort_with: list[tuple[grpc.StatusCode, str]] = []
        self.rewrite: Callable[[list[str]], list[str]] | None = None
        self.issue_uri: str | None = None

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        self.metadata.append({k: v for k, v in context.invocation_metadata() or ()})
        if self.abort_with:
            code, details = self.abort_with.pop(0)
            await context.abort(code, details)
        ttl = timedelta(seconds=request.validity_duration or 3600)
        elements = self.pki.issue(request.csr, ttl, self.clock.now(), self.issue_uri)
        if self.rewrite is not None:
            elements = self.rewrite(elements)
        return ca_pb2.IstioCertificateResponse(cert_chain=elements)


async def start_fake_ca(
    servicer: FakeCaServicer, directory: Path, now: datetime
) -> tuple[grpc.aio.Server, str]:
    """Serves `servicer` with TLS on a free loopback port; returns (server, "127.0.0.1:PORT")."""
    key_pem, cert_pem = servicer.pki.write_serving(directory, now)
    server = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    await server.start()
    return server, f"127.0.0.1:{port}"
