"""One call on the completion-queue server: the `grpc.aio.ServicerContext` surface a handler
sees, the streaming reads and writes, and the resumption of a handler handed to the loop.

Split from `ca_server.serving.cq_server` (which accepts calls, drives handlers and sends the
answers) so that each reads on its own; the concurrency rules are that module's: a call's
methods run on the completion-queue thread or on the loop, never on both at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Sequence
from typing import Any, Protocol

import grpc

from ca_server.serving.grpc_core import NO_FLAGS, cygrpc


class BatchStarter(Protocol):
    """What a streaming call needs of its server (`CompletionQueueServer.batch`): start a batch
    of operations on the call and await its completion event on the loop."""

    def batch(self, call: Any, operations: Sequence[Any]) -> Awaitable[Any]: ...


class Aborted(Exception):
    """Raised by `UnaryContext.abort`, as `grpc.aio`'s abort raises `AbortError`."""


class Call:
    """One call: what `grpc.aio.ServicerContext` gives a handler, and its final status."""

    __slots__ = (
        "call",
        "closing",
        "code",
        "deadline",
        "details",
        "finished",
        "initial_sent",
        "metadata",
        "method",
        "task",
        "trailing",
    )

    def __init__(self, event: Any) -> None:
        self.call = event.call
        details = event.call_details
        self.method: bytes = details.method
        self.deadline: float = details.deadline
        self.metadata = event.invocation_metadata
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, str | bytes], ...] = ()
        self.initial_sent = False
        self.finished = False
        # Its ReceiveCloseOnServer is pending on its own (a call served on the loop, which is
        # cancelled when the client goes): the final batch must not carry another.
        self.closing = False
        self.task: asyncio.Task[None] | None = None

    # --- the grpc.aio.ServicerContext surface the CA's servicers use ---

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return tuple(self.metadata or ())

    def peer(self) -> str:
        peer = self.call.peer()
        return peer.decode("utf-8", "replace") if isinstance(peer, bytes) else str(peer)

    def auth_context(self) -> dict[str, list[bytes]]:
        context = cygrpc.auth_context(self.call) or {}
        return {
            (key.decode() if isinstance(key, bytes) else key): value
            for key, value in context.items()
        }

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        self.trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.trailing

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def time_remaining(self) -> float:
        return max(self.deadline - time.time(), 0.0)

    def done(self) -> bool:
        return self.finished

    def cancelled(self) -> bool:
        return False

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a status other than OK")
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise Aborted(details)


class StreamCall(Call):
    """A call served as a task on the loop: reads and writes awaited as batch completions."""

    __slots__ = ("server",)

    def __init__(self, event: Any, server: BatchStarter) -> None:
        super().__init__(event)
        self.server = server

    async def read(self) -> bytes | None:
        event = await self.server.batch(self.call, (cygrpc.ReceiveMessageOperation(NO_FLAGS),))
        return event.batch_operations[0].message() if event.success else None

    async def write_bytes(self, data: bytes) -> None:
        operations: list[Any] = [cygrpc.SendMessageOperation(data, NO_FLAGS)]
        if not self.initial_sent:
            operations.insert(0, cygrpc.SendInitialMetadataOperation((), NO_FLAGS))
            self.initial_sent = True
        event = await self.server.batch(self.call, operations)
        if not event.success:
            raise asyncio.CancelledError("the client is gone")


class UnaryContext(Call):
    """Unary calls (the CA's own methods and health `Check`)."""

    __slots__ = ()


class StreamContext:
    """`grpc.aio.ServicerContext` for a streaming call, with `read`/`write` (de)serializing."""

    def __init__(self, call: StreamCall, handler: grpc.RpcMethodHandler) -> None:
        self._call = call
        self._handler = handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)

    async def read(self) -> Any:
        data = await self._call.read()
        if data is None:
            return grpc.aio.EOF
        deserialize = self._handler.request_deserializer
        return deserialize(data) if deserialize else data

    async def write(self, message: Any) -> None:
        serialize = self._handler.response_serializer
        await self._call.write_bytes(serialize(message) if serialize else message)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        await self._call.abort(code, details, trailing_metadata)


class Resume:
    """Continues a coroutine the CQ thread started and that suspended on `first` (what it
    yielded to its driver: a future, or None for a bare yield such as `to_the_loop`'s), as
    part of a loop task."""

    def __init__(self, coroutine: Any, first: Any) -> None:
        self._coroutine = coroutine
        self._first = first

    def __await__(self) -> Generator[Any, None, Any]:
        value = self._first
        if value is None:  # handed over with nothing to wait for: go on now, on the loop
            try:
                value = self._coroutine.send(None)
            except StopIteration as done:
                return done.value
        while True:
            try:
                yield value
            except BaseException as exc:
                try:
                    value = self._coroutine.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = self._coroutine.send(None)
                except StopIteration as done:
                    return done.value


async def requests_of(context: StreamContext) -> AsyncIterator[Any]:
    """The messages of a streaming call, until the client half-closes."""
    while True:
        message = await context.read()
        if message is grpc.aio.EOF:
            return
        yield message
