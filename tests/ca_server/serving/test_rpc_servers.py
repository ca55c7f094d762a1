"""The completion-queue server (`ca_server.serving.cq_server`) behaves as `grpc.aio`'s does.

Every test runs against both servers `--rpc-server` chooses between, in-process, with real
gRPC clients: answers from a handler that never waits (run inline on the completion-queue
thread) and from one that waits on the loop (handed over), metadata and peer, `abort` with the
admission trailer, a handler's exception (and a request decoder's), unknown methods,
deadlines, the health service's `Check` and streaming `Watch`, reflection over one bidi
stream, and graceful shutdown (calls in flight drained within the grace, cancelled after it).
The CA's own wire tests run on both paths with `MESHCA_TEST_RPC_SERVER`
(tests/support/ca_process.py). Last, the start-time check of the installed grpcio, given a core
that lacks a name or another version: `auto` falls back to grpc.aio with one WARNING,
`completion-queue` asked for by name is refused (`meshca ca`: one line, exit 2).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

import ca_server.serving.grpc_core as grpc_core
from ca_server.config import ConfigError
from ca_server.loop_handoff import to_the_loop
from ca_server.serving.cq_server import CompletionQueueServer, check_rpc_server, rpc_server_for
from tests.support.loop import LoopThread
from tests.support.processes import child_env, free_port, wait_for

SERVICE = "test.Echo"
STRICT_SERVICE = "test.Strict"  # its request decoder raises, as protobuf's does on garbage


def refuse_to_decode(data: bytes) -> bytes:
    raise ValueError(f"not a request ({len(data)} bytes)")


class Echo:
    """Unary handlers, `async def` as the CA's servicers are, following the completion-queue
    server's rule: `await to_the_loop()` before a timer or a task."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.finished: list[str] = []

    async def now(self, request: bytes, context: Any) -> bytes:
        headers = dict(context.invocation_metadata())
        return b"|".join(
            [request, headers.get("x-test", "-").encode(), context.peer().split(":")[0].encode()]
        )

    async def threads(self, request: bytes, context: Any) -> bytes:
        """Where its steps ran: before `to_the_loop()`, after it, after a task it created."""
        seen = [threading.current_thread().name]
        await to_the_loop()
        seen.append(threading.current_thread().name)
        await asyncio.create_task(asyncio.sleep(0.01))
        seen.append(threading.current_thread().name)
        return "|".join(seen).encode()

    async def waits(self, request: bytes, context: Any) -> bytes:
        await to_the_loop()
        try:
            await asyncio.sleep(float(request.decode()))
        except asyncio.CancelledError:
            self.finished.append("cancelled")
            raise
        answer = await asyncio.to_thread(lambda: b"waited")
        self.finished.append("waits")
        return answer

    async def refuse(self, request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("grpc-retry-pushback-ms", "250"),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "busy: come back later")
        raise AssertionError("unreachable")

    async def refuse_later(self, request: bytes, context: Any) -> bytes:
        await to_the_loop()
        await asyncio.sleep(0.01)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not you")
        raise AssertionError("unreachable")

    async def boom(self, request: bytes, context: Any) -> bytes:
        raise ValueError("a bug")


@pytest.fixture
def echo() -> Echo:
    return Echo()


@pytest.fixture(params=["completion-queue", "aio"])
def served(
    request: pytest.FixtureRequest, echo: Echo
) -> Iterator[tuple[str, LoopThread, Any, Any]]:
    """(address, loop, server, health servicer) of a server of each kind."""
    with LoopThread() as loop:
        # Debug mode: asyncio refuses a non-thread-safe call on the loop from another thread
        # (the completion-queue thread), which then fails the handler and the test.
        loop.loop.set_debug(True)

        async def start() -> tuple[Any, Any, int]:
            server = rpc_server_for(request.param, [("grpc.max_receive_message_length", 4096)])
            methods = {
                "Now": echo.now,
                "Threads": echo.threads,
                "Waits": echo.waits,
                "Refuse": echo.refuse,
                "RefuseLater": echo.refuse_later,
                "Boom": echo.boom,
            }
            server.add_generic_rpc_handlers(
                [
                    grpc.method_handlers_generic_handler(
                        SERVICE,
                        {n: grpc.unary_unary_rpc_method_handler(f) for n, f in methods.items()},
                    )
                ]
            )
            server.add_generic_rpc_handlers(
                [
                    grpc.method_handlers_generic_handler(
                        STRICT_SERVICE,
                        {
                            "Now": grpc.unary_unary_rpc_method_handler(
                                echo.now, request_deserializer=refuse_to_decode
                            )
                        },
                    )
                ]
            )
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            reflection.enable_server_reflection(
                [SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server
            )
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            return server, health_servicer, port

        server, health_servicer, port = loop.run(start())
        assert isinstance(server, CompletionQueueServer) == (request.param == "completion-queue")
        try:
            yield f"127.0.0.1:{port}", loop, server, health_servicer
        finally:
            loop.run(server.stop(0))


def unary(channel: grpc.Channel, method: str) -> Any:
    return channel.unary_unary(f"/{SERVICE}/{method}")


def test_inline_and_handed_over_answers_with_metadata_and_peer(served):
    address, *_ = served
    with grpc.insecure_channel(address) as channel:
        answer = unary(channel, "Now")(b"hi", metadata=(("x-test", "v1"),), timeout=5)
        assert answer == b"hi|v1|ipv4"
        assert unary(channel, "Waits")(b"0.05", timeout=5) == b"waited"
        # Many at once, both kinds interleaved: each gets its own answer.
        futures = [unary(channel, "Now").future(str(i).encode(), timeout=5) for i in range(50)]
        waits = [unary(channel, "Waits").future(b"0.01", timeout=5) for _ in range(10)]
        assert [f.result().split(b"|")[0] for f in futures] == [str(i).encode() for i in range(50)]
        assert all(f.result() == b"waited" for f in waits)


def test_a_handler_moves_to_the_loop_before_it_touches_it(served):
    """The steady state stays on the completion-queue thread; `to_the_loop()` moves the rest of
    a handler to the loop's thread (where it may create tasks and timers), and on the loop it
    is a no-op. The fixture's loop is in debug mode, which refuses the loop's non-thread-safe
    calls from any other thread."""
    address, _, server, _ = served
    first = "meshca-rpc-cq" if isinstance(server, CompletionQueueServer) else "test-loop"
    with grpc.insecure_channel(address) as channel:
        answers = [unary(channel, "Threads").future(b"", timeout=5) for _ in range(20)]
        assert {f.result() for f in answers} == {f"{first}|test-loop|test-loop".encode()}


def test_to_the_loop_returns_at_once_off_the_completion_queue_thread():
    async def hops() -> int:
        steps = 0
        awaitable = to_the_loop().__await__()
        for _ in awaitable:
            steps += 1
        return steps

    assert asyncio.run(hops()) == 0


def test_abort_sends_the_status_and_trailing_metadata(served):
    address, *_ = served
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            unary(channel, "Refuse")(b"", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "busy: come back later"
        assert ("grpc-retry-pushback-ms", "250") in refused.value.trailing_metadata()
        with pytest.raises(grpc.RpcError) as later:
            unary(channel, "RefuseLater")(b"", timeout=5)
        assert later.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert later.value.details() == "not you"


def test_handler_exception_is_unknown_and_logged(served, caplog: pytest.LogCaptureFixture):
    address, *_ = served
    with (
        grpc.insecure_channel(address) as channel,
        caplog.at_level(logging.ERROR),
        pytest.raises(grpc.RpcError) as failed,
    ):
        unary(channel, "Boom")(b"", timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNKNOWN
    assert "a bug" in (failed.value.details() or "")
    assert any(record.exc_info and "a bug" in str(record.exc_info[1]) for record in caplog.records)


def test_a_request_decoder_that_raises_is_unknown_and_logged_on_both(
    served, caplog: pytest.LogCaptureFixture
):
    """As grpc.aio answers it (the completion-queue server said INTERNAL). The CA's own services
    decode leniently and never get here (tests/ca_server/serving/test_endpoints.py)."""
    address, *_ = served
    with (
        grpc.insecure_channel(address) as channel,
        caplog.at_level(logging.ERROR),
        pytest.raises(grpc.RpcError) as failed,
    ):
        channel.unary_unary(f"/{STRICT_SERVICE}/Now")(b"\xff", timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNKNOWN
    assert "not a request (1 bytes)" in (failed.value.details() or "")
    assert any(r.exc_info and "not a request" in str(r.exc_info[1]) for r in caplog.records)
    with grpc.insecure_channel(address) as channel:
        assert unary(channel, "Now")(b"after", timeout=5).startswith(b"after|")


def test_unknown_method_oversized_request_and_deadline(served):
    address, *_ = served
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary("/test.Echo/Nope")(b"", timeout=5)
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as large:
            unary(channel, "Now")(b"x" * 8192, timeout=5)
        assert large.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as late:
            unary(channel, "Waits")(b"1", timeout=0.2)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert unary(channel, "Now")(b"after", timeout=5).startswith(b"after|")


def test_a_client_that_goes_cancels_the_waiting_handler(served, echo: Echo):
    """As grpc.aio does: the handler's task is cancelled (so its admission slot is released)
    when the client's deadline passes, not when the handler would have finished."""
    address, *_ = served
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as late:
            unary(channel, "Waits")(b"30", timeout=0.3)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: "cancelled" in echo.finished, 5, "the handler to be cancelled")
        assert unary(channel, "Waits")(b"0.01", timeout=5) == b"waited"


def test_health_check_and_watch_stream(served):
    address, loop, server, health_servicer = served
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        assert stub.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(request, timeout=10)
        seen: queue.Queue[int] = queue.Queue()

        def read() -> None:
            try:
                for reply in watch:
                    seen.put(reply.status)
            except grpc.RpcError as exc:  # our own cancel() below ends the stream
                assert exc.code() == grpc.StatusCode.CANCELLED

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert seen.get(timeout=5) == health_pb2.HealthCheckResponse.SERVING
        loop.run(health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        assert seen.get(timeout=5) == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        reader.join(5)
        if isinstance(server, CompletionQueueServer):  # the handler's task ended with the call
            wait_for(lambda: not server._tasks, 5, "the Watch task to end")
        # The cancelled stream is gone from the server; the next call is answered.
        assert stub.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_reflection_answers_several_requests_on_one_stream(served):
    address, *_ = served
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=health.SERVICE_NAME),
        ]
        replies = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    assert {s.name for s in replies[0].list_services_response.service} == {
        SERVICE,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    }
    assert replies[1].file_descriptor_response.file_descriptor_proto


def test_graceful_stop_drains_calls_in_flight_then_cancels(served):
    address, loop, server, _ = served
    with grpc.insecure_channel(address) as channel:
        short = unary(channel, "Waits").future(b"0.3", timeout=10)
        long = unary(channel, "Waits").future(b"5", timeout=10)
        time.sleep(0.1)  # both are in their handlers
        started = time.monotonic()
        loop.run(server.stop(1.0))
        stopped_after = time.monotonic() - started
        assert short.result() == b"waited"  # drained within the grace
        with pytest.raises(grpc.RpcError) as cut:
            long.result()
        assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert 0.9 <= stopped_after < 3
        with pytest.raises(grpc.RpcError):  # no new calls once stopping
            unary(channel, "Now")(b"", timeout=1)


def core_lacking(name: str) -> SimpleNamespace:
    """grpcio's Cython core as a release without `name` would have it."""
    assert grpc_core.cygrpc is not None
    return SimpleNamespace(
        **{n: getattr(grpc_core.cygrpc, n) for n in grpc_core.REQUIRED_NAMES if n != name}
    )


def build_in_a_loop(choice: str, **checked: Any) -> Any:
    async def build() -> Any:
        return rpc_server_for(choice, [], **checked)

    return asyncio.run(build())


@pytest.mark.parametrize(
    "checked, problem",
    [
        ({"version": "1.99.0"}, "grpcio 1.99.0 is not a tested release (1.85.x)"),
        ({"core": core_lacking("auth_context")}, "grpc._cython.cygrpc lacks auth_context"),
        ({"core": None}, "grpc._cython.cygrpc is not importable"),
    ],
    ids=["untested release", "a private name gone", "no Cython core"],
)
def test_auto_falls_back_to_grpc_aio_with_one_warning(
    checked: dict[str, Any], problem: str, caplog: pytest.LogCaptureFixture
):
    assert grpc_core.completion_queue_problem(**checked) == problem
    with caplog.at_level(logging.WARNING):
        server = build_in_a_loop("auto", **checked)
    assert isinstance(server, grpc.aio.Server)
    assert not isinstance(server, CompletionQueueServer)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"--rpc-server auto: using grpc.aio's server instead of the completion-queue one: {problem}"
    ]
    # The installed grpcio runs it: `auto` takes it, with no warning.
    assert grpc_core.completion_queue_problem() is None


def test_completion_queue_asked_for_by_name_and_not_runnable_is_refused(
    caplog: pytest.LogCaptureFixture,
):
    """Not a silent fall back: the operator chose this server."""
    lacking = core_lacking("CompletionQueue")
    with pytest.raises(ConfigError) as refused:
        build_in_a_loop("completion-queue", core=lacking)
    message = str(refused.value)
    assert message.startswith("--rpc-server completion-queue: the installed grpcio cannot run it")
    assert "lacks CompletionQueue" in message and "--rpc-server auto or aio" in message
    assert "\n" not in message
    check_rpc_server("auto", core=lacking)  # auto and aio are never refused
    check_rpc_server("aio", core=lacking)
    with pytest.raises(ConfigError):
        check_rpc_server("completion-queue", version="2.0.0")


@pytest.mark.process  # runs `meshca ca`
def test_meshca_ca_with_an_unrunnable_completion_queue_server_says_one_line_and_exits_2(
    tmp_path: Path,
):
    """The name list a later grpcio would fail, given to the command's own process; before,
    it fell back to grpc.aio and served (so this ran into its timeout)."""
    program = (
        "import sys; import ca_server.serving.grpc_core as core; "
        "core.REQUIRED_NAMES = (*core.REQUIRED_NAMES, 'NotInThisGrpcio'); "
        "from meshca.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, "ca", "--data-dir", str(tmp_path / "data"),
         "--listen", f"127.0.0.1:{free_port()}",
         "--monitoring-listen", f"127.0.0.1:{free_port()}",
         "--workers", "1", "--rpc-server", "completion-queue"],
        env=child_env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "meshca ca: --rpc-server completion-queue: the installed grpcio cannot run it "
        "(grpc._cython.cygrpc lacks NotInThisGrpcio); use --rpc-server auto or aio (grpc.aio's "
        "server), or a grpcio release in 1.85.x"
    ]
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_stopping_a_server_that_never_started_returns():
    async def stop_unstarted() -> None:
        server = rpc_server_for("completion-queue", [])
        server.add_insecure_port("127.0.0.1:0")
        await asyncio.wait_for(server.stop(1), 5)

    asyncio.run(stop_unstarted())
