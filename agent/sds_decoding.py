"""Registering the SDS service with request decoders that never raise.

grpc decodes each request before the servicer sees it. With the generated registration, bytes
that are not a `DiscoveryRequest` ended a stream with status OK and nothing logged (the request
iterator simply stopped), and failed `FetchSecrets` with `UNKNOWN` and a traceback. Here a
failed decode becomes an `UndecodableMessage` that `agent.sds` refuses with
`INVALID_ARGUMENT` and a log line naming the stream, like any other bad request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError

from meshca.grpc_services import add_service

SERVICE_NAME = "envoy.service.secret.v3.SecretDiscoveryService"


@dataclass(frozen=True)
class UndecodableMessage:
    """Request bytes that did not decode; `problem` is the operator-facing explanation."""

    problem: str


def _lenient(message_class: Any) -> Callable[[bytes], Any]:
    type_name = message_class.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return UndecodableMessage(
                f"an SDS request ({len(data)} bytes) does not decode as {type_name}; "
                "the client is not speaking the SDS protocol (or its strings are not UTF-8)"
            )

    return decode


def add_sds_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Like the generated `add_SecretDiscoveryServiceServicer_to_server`, with lenient decoding."""
    handlers = {
        "DeltaSecrets": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaSecrets,
            request_deserializer=_lenient(discovery_pb2.DeltaDiscoveryRequest),
            response_serializer=discovery_pb2.DeltaDiscoveryResponse.SerializeToString,
        ),
        "StreamSecrets": grpc.stream_stream_rpc_method_handler(
            servicer.StreamSecrets,
            request_deserializer=_lenient(discovery_pb2.DiscoveryRequest),
            response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString,
        ),
        "FetchSecrets": grpc.unary_unary_rpc_method_handler(
            servicer.FetchSecrets,
            request_deserializer=_lenient(discovery_pb2.DiscoveryRequest),
            response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString,
        ),
    }
    add_service(server, SERVICE_NAME, handlers)
