"""The CA's gRPC server on grpcio's completion queue, without `grpc.aio`'s per-call Python cost.

Why: on this stack one RPC with a canned answer costs ~150-170 µs of CPU through `grpc.aio`,
~100 µs through the sync `grpc.server` (a pool of threads), and ~30-40 µs when one thread polls
grpcio's completion queue and answers inline (`bench/stack_ceiling.py`'s floor servers measure
all three in one run; figures in docs/performance.md). Both public servers are built on the
same layer (`grpc._cython.cygrpc`: `Server`, `CompletionQueue`, `request_call`,
`start_server_batch`); this module drives it directly.

Concurrency model (which thread runs what):
- **One completion-queue thread** (`meshca-rpc-cq`) polls the queue. It accepts calls, reads
  unary requests and runs each unary-unary handler inline: the handler is a coroutine
  (`async def`, the same servicers `grpc.aio` runs) and the thread drives it one step. When it
  finishes without waiting for anything (a cached token, a development token, a client
  certificate: every steady-state CSR), the answer is sent from that thread; no other thread,
  no event-loop wake-up, no task.
- **The asyncio loop** (the CA's, given to the server) takes over a handler that suspends (it
  awaits a TokenReview, a JWKS fetch, the API budget): the suspended coroutine is handed to
  the loop, which resumes it as a task and sends its answer. While the CQ thread drives a
  step, the loop is registered as the thread's running loop, so `asyncio.get_running_loop()`
  in handler code refers to the CA's loop.
- **The rule for handler code: `await to_the_loop()` before touching the loop**
  (`ca_server.loop_handoff`, which says why): on the CQ thread it suspends with nothing to wait
  for and this server hands the handler to the loop, which runs the rest; on the loop it
  returns at once. The steady state never gets there, so it stays on the CQ thread.
- **Streaming methods** (health `Watch`, reflection) and anything not unary-unary run as tasks
  on the loop, their reads and writes awaited as batch completions the CQ thread resolves.
  Slower per call, and rare.

So handler code may run on two threads, never at the same time for one call. State it
shares across calls is either locked (`ca_server.admission`, `ca_server.token_cache`, the leaf
ledger, the agent report table), thread-safe (prometheus-client) or replaced by one assignment
(the signer's authority).

Why inline and not "hand every request to the loop": that keeps one thread for handler code,
but costs a cross-thread wake-up and a GIL hand-off per request, the part of `grpc.aio`'s cost
this server exists to remove; with the inline step only the few requests that wait on I/O pay
it.

Behaviour kept from the `grpc.aio` server it replaces: TLS and the mTLS port (the auth context
is read from the call: `x509_pem_cert`, `x509_pem_cert_chain`), metadata and peer, deadlines
(enforced by grpc core; `time_remaining()`), `abort` with trailing metadata (the admission
trailer `grpc-retry-pushback-ms`), `UNIMPLEMENTED` for unknown methods, `UNKNOWN` with a logged
traceback for a handler's exception (and for a request decoder that raises, which the CA's
services never register), `max_receive_message_length` (core), `SO_REUSEPORT`
(a server option), graceful shutdown (no new calls, calls in flight drained for `grace`
seconds, then cancelled).

A private API, decided per run: `ca_server.serving.grpc_core` (the one importer of
`grpc._cython`) checks at start that the installed grpcio is a release this server was tested
with and has every private name it uses (`completion_queue_problem`). With `--rpc-server auto`
(the default) `rpc_server_for` falls back to `grpc.aio.server` with one WARNING when anything is
missing; `--rpc-server completion-queue` asked for by name is refused instead
(`check_rpc_server`: a `ConfigError`, one line and exit 2 from `meshca ca`), so an operator who
chose it is never served by the other silently. grpcio itself is not pinned below a next release
(pyproject.toml): the agent never runs this server, and a newer grpcio (a security release) costs
the CA only this server, not its start. One call's objects (the servicer context, streaming
reads and writes, the resumption on the loop) are in `ca_server.serving.cq_calls`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from ca_server.config import RPC_SERVER_CHOICES, ConfigError
from ca_server.loop_handoff import mark_inline_thread
from ca_server.serving.cq_calls import (
    Aborted,
    Call,
    Resume,
    StreamCall,
    StreamContext,
    UnaryContext,
    requests_of,
)
from ca_server.serving.grpc_core import (
    NO_FLAGS,
    TESTED_GRPCIO,
    completion_queue_problem,
    cygrpc,
)

log = logging.getLogger(__name__)


def check_rpc_server(choice: str, core: Any = cygrpc, version: str = grpc.__version__) -> None:
    """`ConfigError` when `--rpc-server` names a server this grpcio cannot run: only
    `completion-queue` asked for by name (`auto` falls back to `grpc.aio` instead)."""
    if choice not in RPC_SERVER_CHOICES:
        raise ConfigError(f"--rpc-server {choice!r}: choose one of {', '.join(RPC_SERVER_CHOICES)}")
    if choice != "completion-queue":
        return
    problem = completion_queue_problem(core, version)
    if problem is not None:
        raise ConfigError(
            f"--rpc-server completion-queue: the installed grpcio cannot run it ({problem}); "
            "use --rpc-server auto or aio (grpc.aio's server), or a grpcio release in "
            f"{', '.join(TESTED_GRPCIO)}x"
        )


def rpc_server_for(
    choice: str,
    options: Sequence[tuple[str, Any]],
    loop: asyncio.AbstractEventLoop | None = None,
    *,
    core: Any = cygrpc,
    version: str = grpc.__version__,
) -> grpc.aio.Server:
    """The CA's gRPC server: this module's (`completion-queue`, `ConfigError` when this grpcio
    cannot run it), `grpc.aio`'s (`aio`), or the first when the installed grpcio allows it and
    else the second with one WARNING (`auto`, the default). Call from the CA's loop. `core`
    and `version` as `completion_queue_problem`'s."""
    check_rpc_server(choice, core, version)
    if choice != "aio":
        problem = completion_queue_problem(core, version)
        if problem is None:
            log.info("gRPC server: completion-queue (grpcio %s)", version)
            return CompletionQueueServer(options, loop or asyncio.get_running_loop())
        log.warning(
            "--rpc-server %s: using grpc.aio's server instead of the completion-queue one: %s",
            choice,
            problem,
        )
    return grpc.aio.server(options=list(options))


_STATUS_OK = grpc.StatusCode.OK.value[0]
_STATUS_UNKNOWN = grpc.StatusCode.UNKNOWN


class CompletionQueueServer(grpc.aio.Server):
    """The `grpc.aio.Server` surface `ca_server.server` uses, on one completion-queue thread.

    A subclass of `grpc.aio.Server` so servicer helpers pick their asyncio flavour
    (`grpc_reflection` checks `isinstance(server, grpc.aio.Server)`)."""

    def __init__(self, options: Sequence[tuple[str, Any]], loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue = cygrpc.CompletionQueue()
        self._server = cygrpc.Server(tuple(options), False)
        self._server.register_completion_queue(self._queue)
        self._generic: list[grpc.GenericRpcHandler] = []
        self._registered: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        self._handlers: dict[bytes, grpc.RpcMethodHandler | None] = {}
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # calls served on the loop
        # Held to start a batch or to shut the queue down: no batch may start on a closed queue.
        self._lock = threading.Lock()
        self._accepting = False
        self._closed = False
        self._shutdown_done: asyncio.Future[None] | None = None
        self._stopped = asyncio.Event()
        self._request_tag = object()
        self._shutdown_tag = object()
        # Whether the loop has callbacks waiting. Handlers hand themselves to the loop before
        # scheduling anything (`to_the_loop`); this is the net for one that does not, whose
        # callback would otherwise sit there until the loop wakes. Feature-detected, else
        # always wake it.
        self._ready_queue = getattr(loop, "_ready", None)

    # --- handlers ---

    def add_generic_rpc_handlers(
        self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]
    ) -> None:
        self._generic.extend(generic_rpc_handlers)
        self._handlers.clear()

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._registered.setdefault(service_name, {}).update(method_handlers)
        self._handlers.clear()

    def _handler_for(self, method: bytes) -> grpc.RpcMethodHandler | None:
        try:
            return self._handlers[method]
        except KeyError:
            pass
        name = method.decode("utf-8", "replace")
        service, _, short = name.lstrip("/").partition("/")
        handler = self._registered.get(service, {}).get(short)
        if handler is None:
            details = _HandlerCallDetails(name, ())
            for generic in self._generic:
                handler = generic.service(details)
                if handler is not None:
                    break
        if len(self._handlers) < 1024:  # methods probed by clients do not grow it forever
            self._handlers[method] = handler
        return handler

    # --- ports and life ---

    def add_insecure_port(self, address: str) -> int:
        return self._add_port(address, None)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._add_port(address, server_credentials._credentials)

    def _add_port(self, address: str, credentials: Any) -> int:
        port = self._server.add_http2_port(address.encode(), credentials)
        if port == 0:
            raise RuntimeError(f"Failed to bind to address {address}")
        return int(port)

    async def start(self) -> None:
        self._server.start()
        self._accepting = True
        for _ in range(4):  # a few calls accepted ahead, so a burst does not wait on the loop
            self._request_call()
        self._thread = threading.Thread(target=self._poll, name="meshca-rpc-cq", daemon=True)
        self._thread.start()

    async def stop(self, grace: float | None) -> None:
        if self._shutdown_done is not None:
            await asyncio.shield(self._shutdown_done)
            return
        self._shutdown_done = self._loop.create_future()
        if self._thread is None:  # never started: nothing to drain
            self._shutdown_done.set_result(None)
            self._stopped.set()
            return
        with self._lock:
            self._accepting = False
            self._server.shutdown(self._queue, self._shutdown_tag)
        try:
            if grace:
                await asyncio.wait_for(asyncio.shield(self._shutdown_done), grace)
        except TimeoutError:
            pass
        finally:
            self._server.cancel_all_calls()
        await asyncio.shield(self._shutdown_done)
        while self._tasks:  # handlers still waiting: their calls are cancelled, end them
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        with self._lock:
            self._closed = True
            self._queue.shutdown()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._stopped.set()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def add_generic_rpc_handler(self, handler: Any) -> None:  # pragma: no cover - aio API
        self.add_generic_rpc_handlers([handler])

    # --- the completion-queue thread ---

    def _request_call(self) -> None:
        self._server.request_call(self._queue, self._queue, self._request_tag)

    def _start_batch(self, call: Any, operations: Sequence[Any], tag: Any) -> bool:
        """Starts `operations` on `call` unless the queue is closing (the call is over then)."""
        with self._lock:
            if self._closed:
                return False
            call.start_server_batch(operations, tag)
            return True

    def _track(self, coroutine: Any) -> asyncio.Task[None]:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _poll(self) -> None:
        asyncio.events._set_running_loop(self._loop)
        mark_inline_thread()
        operation_complete = cygrpc.CompletionType.operation_complete
        while True:
            event = self._queue.poll()
            if event.completion_type != operation_complete:
                if event.completion_type == cygrpc.CompletionType.queue_shutdown:
                    return
                continue
            try:
                tag = event.tag
                if tag is self._request_tag:
                    self._accepted(event)
                elif tag is self._shutdown_tag:
                    self._loop.call_soon_threadsafe(_resolve, self._shutdown_done, None)
                else:
                    tag(event)
            except Exception:
                log.exception("the RPC server failed to handle an event; going on")
            event = None  # let a finished call go before the next poll

    def _accepted(self, event: Any) -> None:
        with self._lock:
            accepting = self._accepting
            if accepting:
                self._request_call()
        if not event.success:
            return
        handler = self._handler_for(event.call_details.method)
        if handler is None:
            call = UnaryContext(event)
            call.code, call.details = grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
            self._send_status(call)
        elif handler.request_streaming or handler.response_streaming:
            stream = StreamCall(event, self)
            self._loop.call_soon_threadsafe(self._start_stream, stream, handler)
        else:
            call = UnaryContext(event)
            self._start_batch(
                call.call,
                (cygrpc.ReceiveMessageOperation(NO_FLAGS),),
                lambda received: self._unary_received(call, handler, received),
            )

    def _unary_received(
        self, call: UnaryContext, handler: grpc.RpcMethodHandler, event: Any
    ) -> None:
        data = event.batch_operations[0].message() if event.success else None
        if data is None:  # cancelled, past its deadline, or a client that sent no message
            call.code, call.details = grpc.StatusCode.INTERNAL, "the request has no message"
            self._send_status(call)
            return
        try:
            deserialize = handler.request_deserializer
            request = deserialize(data) if deserialize else data
        except Exception as exc:  # a decoder that raises: as grpc.aio answers it (the CA's
            self._failed(call, exc)  # services decode leniently, meshca.grpc_services)
            return
        self._drive(call, handler, handler.unary_unary(request, call))

    def _drive(self, call: UnaryContext, handler: grpc.RpcMethodHandler, result: Any) -> None:
        """Runs the handler's first step here; hands what suspends to the loop."""
        if not inspect.iscoroutine(result):  # a synchronous handler answered already
            self._respond(call, handler, result)
            return
        try:
            yielded = result.send(None)
        except StopIteration as done:
            self._respond(call, handler, done.value)
        except Aborted:
            self._send_status(call)
        except Exception as exc:
            self._failed(call, exc)
        else:
            self._loop.call_soon_threadsafe(self._resume, call, handler, result, yielded)
            return
        if self._ready_queue is None or self._ready_queue:
            self._loop.call_soon_threadsafe(_nothing)  # wake the loop for what was scheduled

    def _resume(
        self, call: UnaryContext, handler: grpc.RpcMethodHandler, coro: Any, first: Any
    ) -> None:
        async def finish() -> None:
            try:
                response = await Resume(coro, first)
            except Aborted:
                self._send_status(call)
            except asyncio.CancelledError:
                if not call.finished:  # else the client is gone: nothing to send
                    call.code, call.details = grpc.StatusCode.CANCELLED, "the call was cancelled"
                    self._send_status(call)
            except Exception as exc:
                self._failed(call, exc)
            else:
                self._respond(call, handler, response)

        call.task = self._track(finish())
        # As grpc.aio does: a client that cancels (or runs past its deadline) while the handler
        # waits cancels the handler, which releases its admission slot at once.
        call.closing = True
        self._start_batch(
            call.call,
            (cygrpc.ReceiveCloseOnServerOperation(NO_FLAGS),),
            lambda event: self._loop.call_soon_threadsafe(self._client_closed, call, event),
        )

    def _respond(self, call: Call, handler: grpc.RpcMethodHandler, response: Any) -> None:
        try:
            serialize = handler.response_serializer
            data = serialize(response) if serialize else response
        except Exception as exc:
            self._failed(call, exc)
            return
        call.finished = True
        operations = [
            cygrpc.SendInitialMetadataOperation((), NO_FLAGS),
            cygrpc.SendMessageOperation(data, NO_FLAGS),
            cygrpc.SendStatusFromServerOperation(call.trailing, _STATUS_OK, b"", NO_FLAGS),
        ]
        if not call.closing:
            operations.append(cygrpc.ReceiveCloseOnServerOperation(NO_FLAGS))
        self._start_batch(call.call, operations, _ignore)

    def _failed(self, call: Call, exc: BaseException) -> None:
        log.error(
            "Exception in the handler of %s",
            call.method.decode("utf-8", "replace"),
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        call.code, call.details = _STATUS_UNKNOWN, f"Unexpected {type(exc)}: {exc}"
        self._send_status(call)

    def _send_status(self, call: Call) -> None:
        """Ends the call with its status (and its trailing metadata)."""
        call.finished = True
        code = call.code or _STATUS_UNKNOWN
        operations: list[Any] = [
            cygrpc.SendStatusFromServerOperation(
                call.trailing, code.value[0], call.details.encode(), NO_FLAGS
            )
        ]
        if not call.initial_sent:
            operations.insert(0, cygrpc.SendInitialMetadataOperation((), NO_FLAGS))
        if not call.closing:
            operations.append(cygrpc.ReceiveCloseOnServerOperation(NO_FLAGS))
        self._start_batch(call.call, operations, _ignore)

    # --- streaming calls, on the loop ---

    def batch(self, call: Any, operations: Sequence[Any]) -> Awaitable[Any]:
        """Starts a batch of operations on `call`; the future resolves (on the loop) with the
        completion event."""
        future = self._loop.create_future()
        started = self._start_batch(
            call,
            tuple(operations),
            lambda event: self._loop.call_soon_threadsafe(_resolve, future, event),
        )
        if not started:
            future.set_result(_NOT_STARTED)
        return future

    def _start_stream(self, call: StreamCall, handler: grpc.RpcMethodHandler) -> None:
        call.task = self._track(self._serve_stream(call, handler))
        self._start_batch(
            call.call,
            (cygrpc.ReceiveCloseOnServerOperation(NO_FLAGS),),
            lambda event: self._loop.call_soon_threadsafe(self._client_closed, call, event),
        )

    def _client_closed(self, call: Call, event: Any) -> None:
        """The client is done with the call: if it went before the answer, stop the handler."""
        if not call.finished and call.task is not None:
            call.finished = True  # nothing more can be sent
            call.task.cancel()

    async def _serve_stream(self, call: StreamCall, handler: grpc.RpcMethodHandler) -> None:
        context = StreamContext(call, handler)
        try:
            if handler.request_streaming:
                request: Any = requests_of(context)
            else:
                request = await context.read()
                if request is grpc.aio.EOF:
                    raise asyncio.CancelledError("no request")
            behaviour: Callable[..., Any] = (
                handler.unary_stream
                or handler.stream_stream
                or handler.unary_unary
                or handler.stream_unary
            )
            result = behaviour(request, context)
            if handler.response_streaming and inspect.isasyncgen(result):
                async for message in result:
                    await context.write(message)
            else:
                response = await result if inspect.isawaitable(result) else result
                if not handler.response_streaming and response is not None:
                    await context.write(response)
        except Aborted:
            pass
        except asyncio.CancelledError:
            return  # the client went, or the server is stopping: nothing to send
        except Exception as exc:
            if not call.finished:
                log.error(
                    "Exception in the handler of %s",
                    call.method.decode("utf-8", "replace"),
                    exc_info=(type(exc), exc, exc.__traceback__),
                )
                call.code, call.details = _STATUS_UNKNOWN, f"Unexpected {type(exc)}: {exc}"
        if call.finished:
            return
        if call.code is None:
            call.code = grpc.StatusCode.OK
        call.finished = True
        code = call.code
        operations: list[Any] = [
            cygrpc.SendStatusFromServerOperation(
                call.trailing, code.value[0], call.details.encode(), NO_FLAGS
            )
        ]
        if not call.initial_sent:
            operations.insert(0, cygrpc.SendInitialMetadataOperation((), NO_FLAGS))
        self._start_batch(call.call, tuple(operations), _ignore)


class _HandlerCallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple[Any, ...]) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class _NotStarted:
    """The completion of a batch that was not started (the server had stopped)."""

    success = False
    batch_operations = ()


_NOT_STARTED = _NotStarted()


def _resolve(future: asyncio.Future[Any] | None, value: Any) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def _nothing() -> None:
    pass


def _ignore(event: Any) -> None:
    pass
