"""Registering a gRPC service whose requests the daemon decodes itself.

The generated `add_*Servicer_to_server` functions decode each request with protobuf inside
grpc, where a request that does not decode becomes a traceback and a status the client cannot
act on. meshca's servers instead hand grpc their own lenient decoders (which return a value
naming the problem, so the handler refuses it like any other bad request: the CA's
`ca_server.request_decoding` and `ca_server.report_service`, the agent's `agent.sds_decoding`
and `agent.workload_api`) and register the method handlers here, the way the generated code
does: as a generic handler and as registered methods (grpc's faster lookup by method path).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc


def add_service(
    server: grpc.aio.Server, service_name: str, handlers: Mapping[str, grpc.RpcMethodHandler]
) -> None:
    """Serves `handlers` (method name → handler) as `service_name` on `server`."""
    handlers = dict(handlers)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)
