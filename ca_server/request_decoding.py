"""Decoding `IstioCertificateRequest` bytes without ever raising, so every refusal is audited.

grpc decodes a request before the handler runs. The proto declares `csr` as `string`, so a
client that sends raw DER (or any bytes that are not UTF-8) makes the protobuf decoder raise
inside grpc: the caller got `UNKNOWN` with a protobuf message, the CA printed a traceback, and
no audit line or denial metric recorded the request. Here a failed decode becomes a
`meshca.grpc_services.Undecodable` (the one lenient decoder, worded by `_explain`) that
`ca_server.service` refuses like any other malformed CSR (`INVALID_ARGUMENT`, audited, counted
under the `Undecodable`'s reason).

To tell the operator *which* part was wrong, a failed decode is retried with a twin of the
message whose `csr` is `bytes` (built once from the generated descriptor, in a private pool):
if that works, the CSR was the culprit and the message can say what it looked like.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.message import DecodeError

from ca_server.wire import CERTIFICATE_SERVICE
from meshca.grpc_services import Undecodable, add_service, lenient_decoder
from meshca_proto import ca_pb2

_REQUEST = "IstioCertificateRequest"


def _bytes_csr_twin() -> Any:
    """A message class laid out like `IstioCertificateRequest` but with `csr` as `bytes`."""
    file_proto = descriptor_pb2.FileDescriptorProto()
    ca_pb2.DESCRIPTOR.CopyToProto(file_proto)
    file_proto.name = "meshca_lenient/ca.proto"
    del file_proto.service[:]
    del file_proto.message_type[:]
    request = file_proto.message_type.add()
    ca_pb2.IstioCertificateRequest.DESCRIPTOR.CopyToProto(request)
    for field in request.field:
        if field.name == "csr":
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(file_proto)
    descriptor = pool.FindMessageTypeByName(f"{ca_pb2.DESCRIPTOR.package}.{_REQUEST}")
    return message_factory.GetMessageClass(descriptor)


_BytesCsrRequest = _bytes_csr_twin()


def _describe_csr_bytes(csr: bytes) -> str:
    if csr[:1] == b"\x30":
        looks = "it starts like DER (0x30)"
    elif b"-----BEGIN" in csr:
        looks = "it holds a PEM block with non-UTF-8 bytes around or inside it"
    else:
        looks = f"it starts with bytes {csr[:4].hex(' ')}"
    return (
        f"the csr field ({len(csr)} bytes) is not UTF-8 text: {looks}; send the CSR as "
        "PEM text ('-----BEGIN CERTIFICATE REQUEST-----')"
    )


def _explain(data: bytes, expected: str) -> Undecodable:
    """Which part of an undecodable request was wrong: the CSR (`csr-invalid`, saying what it
    looked like) or the rest (`request-malformed`)."""
    try:
        twin = _BytesCsrRequest.FromString(data)
    except DecodeError:
        return Undecodable(
            expected,
            len(data),
            f"the request ({len(data)} bytes) does not decode as an IstioCertificateRequest "
            "(malformed protobuf, or a metadata string that is not UTF-8)",
        )
    csr = bytes(twin.csr)
    try:
        csr.decode("utf-8")
    except UnicodeDecodeError:
        return Undecodable(expected, len(data), _describe_csr_bytes(csr), reason="csr-invalid")
    return Undecodable(
        expected, len(data), "the request's metadata does not decode (a string in it is not UTF-8)"
    )


decode_certificate_request = lenient_decoder(ca_pb2.IstioCertificateRequest, _explain)
"""The request, or an `Undecodable` saying what was wrong; never raises."""


def certificate_service_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    return {
        "CreateCertificate": grpc.unary_unary_rpc_method_handler(
            servicer.CreateCertificate,
            request_deserializer=decode_certificate_request,
            response_serializer=ca_pb2.IstioCertificateResponse.SerializeToString,
        )
    }


def add_certificate_service(servicer: Any, server: grpc.aio.Server) -> None:
    """Like the generated `add_IstioCertificateServiceServicer_to_server`, with the decoder
    above, so undecodable requests reach the handler instead of failing inside grpc."""
    add_service(server, CERTIFICATE_SERVICE, certificate_service_handlers(servicer))
