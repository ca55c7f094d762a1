"""The health and reflection services every CA gRPC server carries (`ca_server.serving.endpoints`),
facing bytes that are not a request, on both servers `--rpc-server` chooses between.

Neither service authenticates, so anyone who reaches the port can send garbage. Before, each
such request logged an ERROR and a traceback, and was answered `UNKNOWN` on `grpc.aio`'s server
but `INTERNAL` on the completion-queue one. Now both answer `INVALID_ARGUMENT`, log one INFO line
per peer per minute (time moved by hand here) and go on serving. Real gRPC over loopback.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from ca_server.serving.cq_server import CompletionQueueServer, rpc_server_for
from ca_server.serving.endpoints import Health
from meshca.clock import FakeClock
from tests.support.loop import LoopThread

OWN_SERVICE = "test.Own"
CHECK = f"/{health.SERVICE_NAME}/Check"
WATCH = f"/{health.SERVICE_NAME}/Watch"
REFLECTION = f"/{reflection.SERVICE_NAME}/ServerReflectionInfo"
GARBAGE = b"\xff\xff\xff\xff"
ENDPOINTS_LOGGER = "ca_server.serving.endpoints"


class Served:
    def __init__(self, address: str, clock: FakeClock) -> None:
        self.address = address
        self.clock = clock


@pytest.fixture(params=["completion-queue", "aio"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    clock = FakeClock()
    with LoopThread() as loop:

        async def start() -> tuple[Any, int]:
            server = rpc_server_for(request.param, [])
            health_service = Health(server, [OWN_SERVICE], checked=[], monotonic=clock.monotonic)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await health_service.serving()
            return server, port

        server, port = loop.run(start())
        assert isinstance(server, CompletionQueueServer) == (request.param == "completion-queue")
        try:
            yield Served(f"127.0.0.1:{port}", clock)
        finally:
            loop.run(server.stop(0))


def send_garbage(channel: grpc.Channel, method: str, messages: list[bytes]) -> grpc.RpcError:
    """Sends `messages` as raw bytes to `method` (its own shape) and returns the refusal."""
    with pytest.raises(grpc.RpcError) as refused:
        if method == CHECK:
            (message,) = messages
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(
                message, timeout=5
            )
        elif method == WATCH:
            (message,) = messages
            list(channel.unary_stream(method)(message, timeout=5))
        else:
            list(channel.stream_stream(method)(iter(messages), timeout=5))
    return refused.value


def log_problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Records a refused request must not leave: a WARNING or worse, or any traceback."""
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.WARNING or r.exc_info
    ]


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ENDPOINTS_LOGGER]


@pytest.mark.parametrize("method", [CHECK, WATCH, REFLECTION], ids=["Check", "Watch", "Info"])
def test_garbage_is_invalid_argument_without_a_traceback(
    served: Served, method: str, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO), grpc.insecure_channel(served.address) as channel:
        refused = send_garbage(channel, method, [GARBAGE])
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        assert "does not decode" in (refused.details() or "")
        assert_still_serving(channel)
    assert log_problems(caplog) == []
    (line,) = refusal_lines(caplog)
    assert method in line and "INVALID_ARGUMENT" in line and "127.0.0.1" in line


def test_reflection_answers_the_requests_before_the_garbage(served: Served):
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    with grpc.insecure_channel(served.address) as channel:
        replies = channel.stream_stream(REFLECTION)(iter([good, GARBAGE, good]), timeout=5)
        first = reflection_pb2.ServerReflectionResponse.FromString(next(replies))
        assert {s.name for s in first.list_services_response.service} >= {OWN_SERVICE}
        with pytest.raises(grpc.RpcError) as refused:
            next(replies)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_refusals_are_logged_once_per_minute_per_peer(
    served: Served, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO), grpc.insecure_channel(served.address) as channel:
        for _ in range(3):
            for method in (CHECK, WATCH, REFLECTION):
                code = send_garbage(channel, method, [GARBAGE]).code()
                assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert len(refusal_lines(caplog)) == 1
        served.clock.advance(59)
        send_garbage(channel, CHECK, [GARBAGE])
        assert len(refusal_lines(caplog)) == 1
        served.clock.advance(2)
        send_garbage(channel, WATCH, [GARBAGE])
        lines = refusal_lines(caplog)
        assert len(lines) == 2
        assert "9 more such lines held back" in lines[1]
        assert_still_serving(channel)
    assert log_problems(caplog) == []


def assert_still_serving(channel: grpc.Channel) -> None:
    """A well-formed Check, Watch and reflection request are answered as before."""
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="")
    assert stub.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    watch = stub.Watch(request, timeout=5)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    listing = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([listing]), timeout=5
    )
    assert OWN_SERVICE in {s.name for s in reply.list_services_response.service}
