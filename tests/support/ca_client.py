"""A plain gRPC client of the CA's wire API, for tests (the agent has its own, production one)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf import struct_pb2

from meshca_proto import ca_pb2, ca_pb2_grpc, report_pb2


@contextmanager
def ca_stub(
    addr: str,
    root_pem: bytes,
    *,
    client_key_pem: bytes | None = None,
    client_chain_pem: bytes | None = None,
    server_name: str = "localhost",
) -> Iterator[ca_pb2_grpc.IstioCertificateServiceStub]:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root_pem,
        private_key=client_key_pem,
        certificate_chain=client_chain_pem,
    )
    options = [("grpc.ssl_target_name_override", server_name)]
    with grpc.secure_channel(addr, credentials, options=options) as channel:
        yield ca_pb2_grpc.IstioCertificateServiceStub(channel)


def create_certificate(
    stub: ca_pb2_grpc.IstioCertificateServiceStub,
    csr: str,
    *,
    token: str | None = None,
    ttl_seconds: int = 0,
    metadata: dict[str, Any] | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """Calls CreateCertificate and returns `cert_chain`; raises `grpc.RpcError` on refusal."""
    request = ca_pb2.IstioCertificateRequest(csr=csr, validity_duration=ttl_seconds)
    if metadata:
        struct = struct_pb2.Struct()
        struct.update(metadata)
        request.metadata.CopyFrom(struct)
    call_headers = list(headers)
    if token is not None:
        call_headers.append(("authorization", f"Bearer {token}"))
    response = stub.CreateCertificate(request, metadata=call_headers, timeout=10)
    return list(response.cert_chain)


@contextmanager
def report_channel(addr: str, root_pem: bytes, server_name: str = "localhost") -> Iterator[Any]:
    """A TLS channel to the CA for meshca's own agent report (`meshca.v1`)."""
    credentials = grpc.ssl_channel_credentials(root_certificates=root_pem)
    options = [("grpc.ssl_target_name_override", server_name)]
    with grpc.secure_channel(addr, credentials, options=options) as channel:
        yield channel


def send_report(
    channel: Any,
    request: report_pb2.AgentReportRequest | bytes,
    *,
    token: str | None = None,
) -> report_pb2.AgentReportResponse:
    """Calls `Report` (raw bytes are sent as they are); raises `grpc.RpcError` on refusal."""
    call = channel.unary_unary(
        "/meshca.v1.AgentReportService/Report",
        request_serializer=None,
        response_deserializer=report_pb2.AgentReportResponse.FromString,
    )
    data = request if isinstance(request, bytes) else request.SerializeToString()
    headers = [("authorization", f"Bearer {token}")] if token is not None else []
    response: report_pb2.AgentReportResponse = call(data, metadata=headers, timeout=10)
    return response
