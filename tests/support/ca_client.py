"""A plain gRPC client of the CA's wire API, for tests (the agent has its own, production one)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf import struct_pb2
from meshca_proto import ca_pb2, ca_pb2_grpc


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
