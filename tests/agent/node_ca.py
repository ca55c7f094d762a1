"""An in-process TLS gRPC `IstioCertificateService` that behaves like a CA with a node
authorizer: it accepts only the node agent's token, signs the `ImpersonatedIdentity`, and records
how many calls were in flight at once (each call waits `delay` so overlap is observable)."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

import grpc

from agent.ca_client import IMPERSONATED_IDENTITY_KEY
from certs import SpiffeId, describe_csr, load_csr
from meshca.clock import Clock
from meshca_proto import ca_pb2, ca_pb2_grpc
from tests.agent.pki import Pki

NODE_TOKEN = "node-agent-token"


class ImpersonatingCaServicer(ca_pb2_grpc.IstioCertificateServiceServicer):
    def __init__(
        self,
        pki: Pki,
        clock: Clock,
        *,
        token: str = NODE_TOKEN,
        delay: float = 0.03,
        allowed: set[SpiffeId] | None = None,
    ) -> None:
        self.pki = pki
        self.clock = clock
        self.token = token
        self.delay = delay
        self.allowed = allowed  # None: any identity may be impersonated
        self.in_flight = 0
        self.max_in_flight = 0
        self.issued: Counter[str] = Counter()
        self.order: list[str] = []
        self.fail: set[str] = set()  # identity URIs to refuse with UNAVAILABLE

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            headers = dict(context.invocation_metadata() or ())
            if headers.get("authorization") != f"Bearer {self.token}":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not the node agent")
            fields = request.metadata.fields
            if IMPERSONATED_IDENTITY_KEY not in fields:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no ImpersonatedIdentity")
            uri = fields[IMPERSONATED_IDENTITY_KEY].string_value
            identity = SpiffeId.parse(uri)
            if self.allowed is not None and identity not in self.allowed:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{uri} not on the node")
            if describe_csr(load_csr(request.csr)).uri_sans != (uri,):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "CSR SAN mismatch")
            if uri in self.fail:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "signer unavailable")
            ttl = timedelta(seconds=request.validity_duration or 3600)
            elements = self.pki.issue(request.csr, ttl, self.clock.now(), uri)
            self.issued[uri] += 1
            self.order.append(uri)
            return ca_pb2.IstioCertificateResponse(cert_chain=elements)
        finally:
            self.in_flight -= 1
