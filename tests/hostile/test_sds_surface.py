"""Hostile SDS clients on the agent's Unix socket: bytes that are not SDS (issue #11 item 5:
they ended the stream with OK and nothing logged), protocol violations, and resource names
that try to reach files. Each case checks the exact status and that the server still serves
a well-behaved client afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from agent.file_mounted import FileSecretProvider, FileWatcher
from agent.sds import SECRET_TYPE_URL, SdsServer, SecretResolver
from agent.secrets import SecretCache
from meshca.clock import SystemClock
from tests.support.pki import TestCa

SERVICE = "/envoy.service.secret.v3.SecretDiscoveryService"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NODE = base_pb2.Node(id="sidecar~10.0.0.1~app.default~default.svc.cluster.local")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sds", dir="/tmp") as directory:
        yield Path(directory)


def _request(names: list[str], node: base_pb2.Node | None = NODE) -> bytes:
    request = discovery_pb2.DiscoveryRequest(resource_names=names, type_url=SECRET_TYPE_URL)
    if node is not None:
        request.node.CopyFrom(node)
    return request.SerializeToString()


async def _stream(
    channel: grpc.aio.Channel, method: str, messages: list[bytes]
) -> tuple[grpc.StatusCode, str, int]:
    """Sends raw `messages` on a streaming method; (status, details, responses received)."""
    call = channel.stream_stream(
        f"{SERVICE}/{method}", request_serializer=None, response_deserializer=None
    )

    async def requests() -> AsyncIterator[bytes]:
        for message in messages:
            yield message
        await asyncio.sleep(2)  # keep the stream open: the server must end it

    rpc = call(requests(), timeout=5)
    received = 0
    try:
        async for _ in rpc:
            received += 1
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or "", received
    return await rpc.code(), await rpc.details() or "", received


async def _first_response(
    channel: grpc.aio.Channel, names: list[str]
) -> discovery_pb2.DiscoveryResponse:
    call = channel.stream_stream(
        f"{SERVICE}/StreamSecrets",
        request_serializer=None,
        response_deserializer=discovery_pb2.DiscoveryResponse.FromString,
    )

    async def requests() -> AsyncIterator[bytes]:
        yield _request(names)
        await asyncio.sleep(5)  # a half-close would end the stream before the answer

    rpc = call(requests(), timeout=5)
    try:
        response = await rpc.read()
        assert isinstance(response, discovery_pb2.DiscoveryResponse), response
        return response
    finally:
        rpc.cancel()


async def _fetch(channel: grpc.aio.Channel, body: bytes) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_unary(
        f"{SERVICE}/FetchSecrets", request_serializer=None, response_deserializer=None
    )
    try:
        await call(body, timeout=5)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


@contextlib.asynccontextmanager
async def _sds_server(sock_dir: Path) -> AsyncIterator[SdsServer]:
    """The agent's SDS server serving a workload secret and the root from memory."""
    ca = TestCa()
    cache = SecretCache()
    await cache.publish(ca.issue("app").tls_secret())
    await cache.publish(ca.root_secret())
    files = FileSecretProvider(FileWatcher(clock=SystemClock()))
    server = SdsServer(SecretResolver(cache, files), sock_dir / "sds.sock", fetch_timeout=1)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)
        await files.stop()


async def _still_serves(channel: grpc.aio.Channel) -> None:
    """A well-behaved client is served."""
    response = await _first_response(channel, ["default", "ROOTCA"])
    assert len(response.resources) == 2


async def _until(condition: Callable[[], bool], timeout: float = 5) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


def _serve(sock_dir: Path, scenario: Callable[[grpc.aio.Channel], Awaitable[None]]) -> None:
    async def main() -> None:
        async with (
            _sds_server(sock_dir) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            await scenario(channel)
            await _still_serves(channel)

    asyncio.run(main())


GARBAGE = {
    "random bytes": b"\xff\xfe\xfd",
    "truncated field": b"\x0a\x40abc",
    "non-UTF-8 resource name": b"\x1a\x02\xff\xfe",
    "field number zero": b"\x00\x01",
}


@pytest.mark.parametrize("method", ["StreamSecrets", "DeltaSecrets"])
@pytest.mark.parametrize("body", GARBAGE.values(), ids=list(GARBAGE))
def test_undecodable_stream_request_is_invalid_argument_and_logged(
    sock_dir: Path, caplog: pytest.LogCaptureFixture, method: str, body: bytes
) -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        with caplog.at_level(logging.WARNING, logger="agent.sds"):
            code, details, _ = await _stream(channel, method, [body])
        assert code == INVALID, (code, details)
        assert "does not decode" in details
        assert any("does not decode" in r.getMessage() for r in caplog.records)

    _serve(sock_dir, scenario)


def test_undecodable_request_mid_stream_ends_it(sock_dir: Path) -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        code, details, _ = await _stream(
            channel, "StreamSecrets", [_request(["default"]), b"\xff\xff"]
        )
        assert code == INVALID, (code, details)

    _serve(sock_dir, scenario)


@pytest.mark.parametrize("body", GARBAGE.values(), ids=list(GARBAGE))
def test_undecodable_fetch_is_invalid_argument(sock_dir: Path, body: bytes) -> None:
    """FetchSecrets failed with UNKNOWN and a traceback before."""

    async def scenario(channel: grpc.aio.Channel) -> None:
        code, details = await _fetch(channel, body)
        assert code == INVALID, (code, details)
        assert "does not decode" in details

    _serve(sock_dir, scenario)


BAD_REQUESTS = {
    "no node": (_request(["default"], node=None), "node.id"),
    "empty node id": (_request(["default"], node=base_pb2.Node(cluster="x")), "node.id"),
    "file-cert without a key": (_request(["file-cert:/etc/certs/cert.pem"]), "file-cert:"),
    "file-cert with three parts": (_request(["file-cert:a~b~c"]), "file-cert:"),
    "empty file-root": (_request(["file-root:"]), "file-root:"),
    "100 KB file-cert name": (_request(["file-cert:" + "a" * 100_000]), "more characters"),
}


@pytest.mark.parametrize(("body", "fragment"), BAD_REQUESTS.values(), ids=list(BAD_REQUESTS))
def test_bad_stream_requests_are_invalid_argument(
    sock_dir: Path, body: bytes, fragment: str
) -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        code, details, _ = await _stream(channel, "StreamSecrets", [body])
        assert code == INVALID, (code, details)
        assert fragment in details
        assert len(details) < 1200

    _serve(sock_dir, scenario)


def test_many_abandoned_streams_leave_nothing_behind(sock_dir: Path) -> None:
    """50 clients that subscribe, read one push and hang up: the server's open streams and the
    loop's tasks (a stream's reader and its watches) return to what they were before."""

    async def main() -> None:
        async with (
            _sds_server(sock_dir) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            call = channel.stream_stream(
                f"{SERVICE}/StreamSecrets", request_serializer=None, response_deserializer=None
            )

            async def requests() -> AsyncIterator[bytes]:
                yield _request(["default"])
                await asyncio.sleep(5)

            await _still_serves(channel)  # a first stream, ended: the loop as it idles
            await _until(lambda: server.stream_count == 0)
            streams, tasks = server.stream_count, len(asyncio.all_tasks())

            calls = [call(requests()) for _ in range(50)]
            for rpc in calls:
                await rpc.read()
            assert server.stream_count == streams + 50
            for rpc in calls:
                rpc.cancel()

            def left_behind() -> tuple[int, int]:
                return server.stream_count - streams, len(asyncio.all_tasks()) - tasks

            await _until(lambda: left_behind() == (0, 0))
            assert left_behind() == (0, 0), "(streams, tasks) left behind by 50 hung-up clients"
            await _still_serves(channel)

    asyncio.run(main())
