"""Registering a gRPC service whose requests the daemon decodes itself.

The generated `add_*Servicer_to_server` functions decode each request with protobuf inside
grpc, where a request that does not decode becomes a traceback and a status the client cannot
act on. meshca's servers instead hand grpc the one lenient decoder here (`lenient_decoder`),
which returns an `Undecodable` naming the problem, so the handler refuses it like any other bad
request, and register the method handlers here, the way the generated code does: as a generic
handler and as registered methods (grpc's faster lookup by method path). What differs between
servers is only how the problem is worded and counted: each passes its own `Explain` (the CA's
`ca_server.request_decoding` tells a bad CSR from a bad request, `ca_server.report_service`
refuses an oversized report before decoding it, the agent's `agent.sds_decoding` and
`agent.workload.api` name their protocol) and refuses with its own status and log line.

Servicers written for the generated code (grpcio's health and reflection servicers, which the
CA serves, `ca_server.serving.endpoints`) never see an undecodable request: `lenient_handlers`
wraps their methods so that one is answered `INVALID_ARGUMENT` before the servicer runs (a
request stream ends at the first, after the answers to the requests before it), and reported to
`on_undecodable` (the caller's log, rate-limited by peer). The wrappers are `async def`, as
`grpc.aio`'s servicers are; both of the CA's servers run them (`ca_server.serving.cq_server`).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError


def add_service(
    server: grpc.aio.Server, service_name: str, handlers: Mapping[str, grpc.RpcMethodHandler]
) -> None:
    """Serves `handlers` (method name → handler) as `service_name` on `server`."""
    handlers = dict(handlers)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that do not decode as the method's request message (`expected`), and
    what the server tells the caller about them."""

    expected: str  # the message's full protobuf name
    size: int
    problem: str  # operator-facing: what was wrong and, where it helps, what to send instead
    reason: str = "request-malformed"  # the refusal's label, for servers that count refusals


Explain = Callable[[bytes, str], Undecodable]
"""How a server words a refusal: (the bytes that did not decode, the expected message's full
name) → the `Undecodable` its handler refuses."""


def undecodable_request(data: bytes, expected: str) -> Undecodable:
    """The plain wording, for a server with nothing more specific to say."""
    return Undecodable(
        expected,
        len(data),
        f"the request ({len(data)} bytes) does not decode as a {expected} "
        "(malformed protobuf, or a string field that is not UTF-8)",
    )


def lenient_decoder(
    message_class: Any, explain: Explain = undecodable_request
) -> Callable[[bytes], Any]:
    """`message_class.FromString`, except that bytes it cannot decode become `explain`'s
    `Undecodable` instead of an exception inside grpc; never raises."""
    expected = message_class.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return explain(data, expected)

    return decode


OnUndecodable = Callable[[str, str, Undecodable], None]
"""Told (method path, peer, what arrived) before an undecodable request is refused."""


@dataclass(frozen=True)
class ServicerMethod:
    """One method of a servicer written for the generated code: its behaviour (`async def`,
    or an async generator for a response stream), its messages and its shape."""

    behaviour: Callable[..., Any]
    request: Any  # the request message class
    response: Any  # the response message class
    request_streaming: bool = False
    response_streaming: bool = False


def lenient_handlers(
    service_name: str, methods: Mapping[str, ServicerMethod], on_undecodable: OnUndecodable
) -> dict[str, grpc.RpcMethodHandler]:
    """Method handlers for `methods` (name → method) that decode leniently and answer an
    undecodable request with `INVALID_ARGUMENT` (module docstring); for `add_service`."""
    handlers = {}
    for name, method in methods.items():
        path = f"/{service_name}/{name}"
        decode = lenient_decoder(method.request)
        serialize = method.response.SerializeToString
        if method.request_streaming and method.response_streaming:
            handlers[name] = grpc.stream_stream_rpc_method_handler(
                _stream_request(path, method.behaviour, on_undecodable),
                request_deserializer=decode,
                response_serializer=serialize,
            )
        elif method.request_streaming:
            raise ValueError(f"{path}: a client stream with one answer is not supported here")
        else:
            make = (
                grpc.unary_stream_rpc_method_handler
                if method.response_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            handlers[name] = make(
                _unary_request(path, method.behaviour, on_undecodable),
                request_deserializer=decode,
                response_serializer=serialize,
            )
    return handlers


async def _refuse(
    context: Any, path: str, request: Undecodable, on_undecodable: OnUndecodable
) -> NoReturn:
    on_undecodable(path, context.peer(), request)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{path}: {request.problem}")
    raise AssertionError("abort() returned")  # pragma: no cover - abort always raises


def _unary_request(
    path: str, behaviour: Callable[..., Any], on_undecodable: OnUndecodable
) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):

        async def stream_from(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(context, path, request, on_undecodable)
            async for response in behaviour(request, context):
                yield response

        return stream_from

    async def answer(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(context, path, request, on_undecodable)
        return await behaviour(request, context)

    return answer


def _stream_request(
    path: str, behaviour: Callable[..., Any], on_undecodable: OnUndecodable
) -> Callable[..., Any]:
    async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        undecodable: list[Undecodable] = []

        async def decoded() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    undecodable.append(request)
                    return  # the servicer sees the stream end here
                yield request

        async for response in behaviour(decoded(), context):
            yield response
        if undecodable:
            await _refuse(context, path, undecodable[0], on_undecodable)

    return stream
