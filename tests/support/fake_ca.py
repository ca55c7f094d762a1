"""Fake CAs for agent tests and benches, signing with `tests.support.pki`: the scheduler's
signer in memory (`FakeSigner`), and a CA speaking the real gRPC API (`FakeCaServicer`,
`node_ca`, `start_fake_ca`)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import grpc

from agent.errors import CaRequestError
from agent.signing import SignedCertificate, SigningRequest
from certs import SpiffeId, describe_csr, load_cert, load_csr
from meshca.clock import Clock
from meshca.wire import IMPERSONATED_IDENTITY
from meshca_proto import ca_pb2, ca_pb2_grpc
from tests.support.pki import TestCa

IDENTITY = SpiffeId("cluster.local", "default", "app")


@dataclass(frozen=True)
class SignCall:
    """One call of `FakeSigner.sign`: what was asked, and the fake time it was asked at."""

    identity: SpiffeId
    at: datetime
    impersonate: SpiffeId | None
    renewal: bool


class FakeSigner:
    """The agent's `CertificateSigner` (`agent.scheduler`), in memory: signs each request with
    `pki` at the clock's time; a test swaps `pki` as the CA's activation of a new authority
    would. Records every call; holds calls while `gate` is clear; raises `fail_always` if set,
    and UNAVAILABLE for the identities in `failing`."""

    def __init__(self, pki: TestCa, clock: Clock) -> None:
        self.pki = pki
        self.clock = clock
        self.calls: list[SignCall] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_always: Exception | None = None
        self.failing: set[SpiffeId] = set()

    @property
    def identities(self) -> list[SpiffeId]:
        return [call.identity for call in self.calls]

    @property
    def impersonated(self) -> list[SpiffeId | None]:
        return [call.impersonate for call in self.calls]

    @property
    def renewals(self) -> list[bool]:
        return [call.renewal for call in self.calls]

    async def sign(self, request: SigningRequest) -> SignedCertificate:
        self.calls.append(
            SignCall(request.identity, self.clock.now(), request.impersonate, request.renewal)
        )
        await self.gate.wait()
        if self.fail_always is not None:
            raise self.fail_always
        if request.identity in self.failing:
            raise CaRequestError(grpc.StatusCode.UNAVAILABLE, "CA down")
        now = self.clock.now()
        elements = self.pki.sign_csr(request.csr_pem, request.ttl, now)
        return SignedCertificate(
            chain_pem=elements[0],
            root_bundle_pem=elements[1],
            leaf=load_cert(elements[0]),
            received_at=now,
        )


NODE_TOKEN = "node-agent-token"


class FakeCaServicer(ca_pb2_grpc.IstioCertificateServiceServicer):
    """An in-process CA speaking the real gRPC API: signs with `pki`, records every call.

    As a node agent's CA (`node_agent=True`, see `node_ca`), it behaves like a CA with a node
    authorizer: only `token` authenticates, the `ImpersonatedIdentity` is required and signed
    (if `allowed` lists it, and the CSR asks for exactly it), identities in `fail` get
    UNAVAILABLE. Each call first waits `delay`, so `max_in_flight` shows overlapping calls.
    """

    def __init__(
        self,
        pki: TestCa,
        clock: Clock,
        *,
        node_agent: bool = False,
        token: str | None = None,
        delay: float = 0.0,
        allowed: set[SpiffeId] | None = None,
    ) -> None:
        self.pki = pki
        self.clock = clock
        self.node_agent = node_agent
        self.token = token
        self.delay = delay
        self.allowed = allowed  # None: any identity may be impersonated
        self.metadata: list[dict[str, str]] = []
        self.abort_with: list[tuple[grpc.StatusCode, str]] = []
        self.rewrite: Callable[[list[str]], list[str]] | None = None
        self.issue_uri: str | None = None
        self.fail: set[str] = set()  # identity URIs to refuse with UNAVAILABLE
        self.in_flight = 0
        self.max_in_flight = 0
        self.issued: Counter[str] = Counter()
        self.order: list[str] = []

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            headers = dict(context.invocation_metadata() or ())
            self.metadata.append(headers)
            if self.abort_with:
                code, details = self.abort_with.pop(0)
                await context.abort(code, details)
            if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not the node agent")
            uri = await self._impersonated(request, context) if self.node_agent else None
            uri = uri or self.issue_uri
            if uri in self.fail:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "signer unavailable")
            ttl = timedelta(seconds=request.validity_duration or 3600)
            elements = self.pki.sign_csr(request.csr, ttl, self.clock.now(), uri)
            if uri is not None:
                self.issued[uri] += 1
                self.order.append(uri)
            if self.rewrite is not None:
                elements = self.rewrite(elements)
            return ca_pb2.IstioCertificateResponse(cert_chain=elements)
        finally:
            self.in_flight -= 1

    async def _impersonated(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> str:
        fields = request.metadata.fields
        if IMPERSONATED_IDENTITY not in fields:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no ImpersonatedIdentity")
        uri = fields[IMPERSONATED_IDENTITY].string_value
        if self.allowed is not None and SpiffeId.parse(uri) not in self.allowed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{uri} not on the node")
        if describe_csr(load_csr(request.csr)).uri_sans != (uri,):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "CSR SAN mismatch")
        return uri


def node_ca(pki: TestCa, clock: Clock, *, delay: float = 0.03, **options: Any) -> FakeCaServicer:
    """A CA for a node agent: accepts only `NODE_TOKEN` and signs the impersonated identity."""
    return FakeCaServicer(pki, clock, node_agent=True, token=NODE_TOKEN, delay=delay, **options)


async def start_fake_ca(
    servicer: FakeCaServicer,
    directory: Path,
    now: datetime,
    *,
    also: Callable[[grpc.aio.Server], None] | None = None,
) -> tuple[grpc.aio.Server, str]:
    """Serves `servicer` (and whatever `also` adds to the server) with TLS on a free loopback
    port; returns (server, "127.0.0.1:PORT")."""
    key_pem, cert_pem = servicer.pki.write_serving(directory, now)
    server = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(servicer, server)
    if also is not None:
        also(server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    await server.start()
    return server, f"127.0.0.1:{port}"
