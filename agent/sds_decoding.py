"""Registering the SDS service with request decoders that never raise.

grpc decodes each request before the servicer sees it. With the generated registration, bytes
that are not a `DiscoveryRequest` ended a stream with status OK and nothing logged (the request
iterator simply stopped), and failed `FetchSecrets` with `UNKNOWN` and a traceback. Here a
failed decode becomes a `meshca.grpc_services.Undecodable` (the one lenient decoder, worded for
SDS by `sds_request_decoder`) that `agent.sds` refuses with `INVALID_ARGUMENT` and a log line
naming the stream, like any other bad request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from meshca.grpc_services import Undecodable, add_service, lenient_decoder

SERVICE_NAME = "envoy.service.secret.v3.SecretDiscoveryService"


def _not_sds(data: bytes, expected: str) -> Undecodable:
    return Undecodable(
        expected,
        len(data),
        f"an SDS request ({len(data)} bytes) does not decode as {expected}; "
        "the client is not speaking the SDS protocol (or its strings are not UTF-8)",
    )


def sds_request_decoder(message_class: Any) -> Callable[[bytes], Any]:
    """The lenient decoder for one SDS request message, worded for SDS clients."""
    return lenient_decoder(message_class, _not_sds)


def add_sds_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Like the generated `add_SecretDiscoveryServiceServicer_to_server`, with lenient decoding."""
    handlers = {
        "DeltaSecrets": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaSecrets,
            request_deserializer=sds_request_decoder(discovery_pb2.DeltaDiscoveryRequest),
            response_serializer=discovery_pb2.DeltaDiscoveryResponse.SerializeToString,
        ),
        "StreamSecrets": grpc.stream_stream_rpc_method_handler(
            servicer.StreamSecrets,
            request_deserializer=sds_request_decoder(discovery_pb2.DiscoveryRequest),
            response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString,
        ),
        "FetchSecrets": grpc.unary_unary_rpc_method_handler(
            servicer.FetchSecrets,
            request_deserializer=sds_request_decoder(discovery_pb2.DiscoveryRequest),
            response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString,
        ),
    }
    add_service(server, SERVICE_NAME, handlers)
