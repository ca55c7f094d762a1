"""SDS server behaviour, checked with the generated gRPC client over the real Unix socket."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.rpc import status_pb2
from prometheus_client import CollectorRegistry, Counter

from agent.sds import SECRET_TYPE_URL, SdsServer, SecretResolver
from agent.secrets import SecretCache
from tests.support.pki import TestCa

NODE = base_pb2.Node(id="sidecar~10.0.0.1~app-1.default~default.svc.cluster.local", cluster="app")


@pytest.fixture(scope="module")
def ca() -> TestCa:
    return TestCa()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="sds-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class SdsMetricsForTest:
    sds_pushes: Counter
    sds_nacks: Counter

    @classmethod
    def fresh(cls) -> SdsMetricsForTest:
        registry = CollectorRegistry()
        return cls(
            Counter("sds_pushes", "pushes", ["resource_name"], registry=registry),
            Counter("sds_nacks", "nacks", ["resource_name"], registry=registry),
        )

    def value(self, counter: Counter, name: str) -> float:
        return float(counter.labels(resource_name=name)._value.get())


class Stream:
    """One client stream with explicit send/receive, so tests can see what is (not) sent."""

    def __init__(self, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        self._outgoing: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self.call = stub.StreamSecrets(self._requests())
        self.last: discovery_pb2.DiscoveryResponse | None = None
        # Cancelling `call.read()` would cancel the RPC, so one task reads and tests wait on
        # this queue instead.
        self._incoming: asyncio.Queue[discovery_pb2.DiscoveryResponse | Exception] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for response in self.call:
                self._incoming.put_nowait(response)
        except Exception as exc:
            self._incoming.put_nowait(exc)

    async def _requests(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (request := await self._outgoing.get()) is not None:
            yield request

    def send(
        self,
        names: list[str],
        *,
        node: base_pb2.Node | None = NODE,
        nonce: str = "",
        version: str = "",
        error: str | None = None,
    ) -> None:
        request = discovery_pb2.DiscoveryRequest(
            resource_names=names, type_url=SECRET_TYPE_URL, response_nonce=nonce
        )
        request.version_info = version
        if node is not None:
            request.node.CopyFrom(node)
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        self._outgoing.put_nowait(request)

    def ack(self, names: list[str], error: str | None = None) -> None:
        assert self.last is not None
        version = self.last.version_info if error is None else ""
        self.send(names, nonce=self.last.nonce, version=version, error=error)

    async def recv(self, timeout: float = 2.0) -> discovery_pb2.DiscoveryResponse:
        response = await asyncio.wait_for(self._incoming.get(), timeout)
        if isinstance(response, Exception):
            raise response
        assert isinstance(response, discovery_pb2.DiscoveryResponse), response
        self.last = response
        return response

    async def expect_silence(self, seconds: float = 0.3) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(self._incoming.get(), seconds)

    def close(self) -> None:
        self._outgoing.put_nowait(None)
        self.call.cancel()
        self._reader.cancel()


def secrets_of(response: discovery_pb2.DiscoveryResponse) -> dict[str, secret_pb2.Secret]:
    out = {}
    for packed in response.resources:
        assert packed.type_url == SECRET_TYPE_URL
        secret = secret_pb2.Secret()
        packed.Unpack(secret)
        out[secret.name] = secret
    return out


Scenario = Callable[[SdsServer, sds_pb2_grpc.SecretDiscoveryServiceStub], Awaitable[None]]


def run_with_server(
    sock_dir: Path, cache: SecretCache | None, scenario: Scenario, **server_kwargs: Any
) -> None:
    async def main() -> None:
        server = SdsServer(cache or SecretCache(), sock_dir / "sds.sock", **server_kwargs)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                await scenario(server, sds_pb2_grpc.SecretDiscoveryServiceStub(channel))
        finally:
            await server.stop(0)

    asyncio.run(main())


async def seeded_cache(ca: TestCa, service_account: str = "app") -> SecretCache:
    cache = SecretCache()
    await cache.publish(ca.issue(service_account).tls_secret())
    await cache.publish(ca.root_secret())
    return cache


def test_missing_node_id_is_rejected(ca: TestCa, sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        for node in (None, base_pb2.Node(cluster="app")):
            stream = Stream(stub)
            stream.send(["default"], node=node)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.recv()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "node.id" in (info.value.details() or "")
            stream.close()

    run_with_server(sock_dir, None, scenario)


def test_first_response_then_ack_gets_no_resend(ca: TestCa, sock_dir: Path) -> None:
    metrics = SdsMetricsForTest.fresh()

    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = await seeded_cache(ca)
        server.resolver = SecretResolver(cache)
        stream = Stream(stub)
        stream.send(["default"])
        response = await stream.recv()
        assert response.type_url == SECRET_TYPE_URL
        assert response.nonce
        default = secrets_of(response)["default"]
        assert set(secrets_of(response)) == {"default"}
        expected = cache.get("default")
        assert expected is not None
        assert response.version_info == expected.version
        assert default.tls_certificate.certificate_chain.inline_bytes.startswith(
            b"-----BEGIN CERTIFICATE-----"
        )
        assert b"PRIVATE KEY" in default.tls_certificate.private_key.inline_bytes
        stream.ack(["default"])
        await stream.expect_silence()
        assert metrics.value(metrics.sds_pushes, "default") == 1
        stream.close()

    run_with_server(sock_dir, None, scenario, metrics=metrics)


def test_root_secret_is_a_validation_context(ca: TestCa, sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        server.resolver = SecretResolver(await seeded_cache(ca))
        stream = Stream(stub)
        stream.send(["ROOTCA"])
        root = secrets_of(await stream.recv())["ROOTCA"]
        assert root.validation_context.trusted_ca.inline_bytes == ca.root_pem.encode()
        assert not root.HasField("tls_certificate")
        stream.close()

    run_with_server(sock_dir, None, scenario)


def test_nack_is_counted_logged_and_not_resent(
    ca: TestCa, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = SdsMetricsForTest.fresh()

    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = await seeded_cache(ca)
        server.resolver = SecretResolver(cache)
        stream = Stream(stub)
        stream.send(["default"])
        first = await stream.recv()
        stream.ack(["default"])
        await cache.publish(ca.issue("app").tls_secret())
        second = await stream.recv()
        assert second.version_info != first.version_info
        with caplog.at_level(logging.WARNING, logger="agent.sds"):
            stream.ack(["default"], error="Failed to load certificate chain")
            await stream.expect_silence()
        assert metrics.value(metrics.sds_nacks, "default") == 1
        assert server.nacks == 1
        assert "Failed to load certificate chain" in caplog.text
        assert "default" in caplog.text
        assert "PRIVATE KEY" not in caplog.text
        # A later good version is still pushed.
        await cache.publish(ca.issue("app").tls_secret())
        third = await stream.recv()
        assert third.version_info not in (first.version_info, second.version_info)
        stream.close()

    run_with_server(sock_dir, None, scenario, metrics=metrics)


def test_stale_nonce_is_ignored(ca: TestCa, sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = await seeded_cache(ca)
        server.resolver = SecretResolver(cache)
        stream = Stream(stub)
        stream.send(["default"])
        first = await stream.recv()
        await cache.publish(ca.issue("app").tls_secret())
        second = await stream.recv()
        # An ACK or NACK of the first response arrives after the second was sent: stale.
        stream.send(["default"], nonce=first.nonce, error="late complaint")
        stream.send(["default", "ROOTCA"], nonce=first.nonce, version=first.version_info)
        await stream.expect_silence()
        assert server.nacks == 0
        stream.ack(["default"])
        await stream.expect_silence()
        assert second.nonce != first.nonce
        stream.close()

    run_with_server(sock_dir, None, scenario)


def test_publish_reaches_only_streams_watching_that_name(ca: TestCa, sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = await seeded_cache(ca)
        server.resolver = SecretResolver(cache)
        leaf_streams = [Stream(stub) for _ in range(3)]
        root_stream = Stream(stub)
        for stream in leaf_streams:
            stream.send(["default"])
        root_stream.send(["ROOTCA"])
        firsts = [await stream.recv() for stream in leaf_streams]
        await root_stream.recv()
        for stream in [*leaf_streams, root_stream]:
            stream.ack(["default"] if stream in leaf_streams else ["ROOTCA"])
        rotated = ca.issue("app")
        await cache.publish(rotated.tls_secret())
        for stream, first in zip(leaf_streams, firsts, strict=True):
            pushed = await stream.recv()
            assert pushed.nonce != first.nonce
            assert pushed.version_info != first.version_info
            chain = secrets_of(pushed)["default"].tls_certificate.certificate_chain
            assert chain.inline_bytes == rotated.cert_pem.encode()
        await root_stream.expect_silence()
        for stream in [*leaf_streams, root_stream]:
            stream.close()

    run_with_server(sock_dir, None, scenario)


def test_one_stream_with_several_names_waits_for_each(ca: TestCa, sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = SecretCache()
        server.resolver = SecretResolver(cache)
        stream = Stream(stub)
        stream.send(["default", "ROOTCA"])
        await stream.expect_silence(0.2)
        await cache.publish(ca.root_secret())
        first = await stream.recv()
        assert set(secrets_of(first)) == {"ROOTCA"}
        stream.ack(["default", "ROOTCA"])
        await cache.publish(ca.issue("app").tls_secret())
        second = await stream.recv()
        assert set(secrets_of(second)) == {"default"}
        assert second.version_info != first.version_info
        # A subscription dropping ROOTCA: updates to it are no longer pushed.
        stream.send(["default"], nonce=second.nonce, version=second.version_info)
        await asyncio.sleep(0.2)  # let the server see the new subscription first
        await cache.publish(TestCa().root_secret())
        await stream.expect_silence()
        stream.close()

    run_with_server(sock_dir, None, scenario)


def test_fetch_secrets_returns_current_values(ca: TestCa, sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = await seeded_cache(ca)
        server.resolver = SecretResolver(cache)
        request = discovery_pb2.DiscoveryRequest(node=NODE, resource_names=["default", "ROOTCA"])
        response = await stub.FetchSecrets(request, timeout=2)
        assert set(secrets_of(response)) == {"default", "ROOTCA"}
        rotated = ca.issue("app")
        await cache.publish(rotated.tls_secret())
        response = await stub.FetchSecrets(request, timeout=2)
        chain = secrets_of(response)["default"].tls_certificate.certificate_chain
        assert chain.inline_bytes == rotated.cert_pem.encode()
        missing = discovery_pb2.DiscoveryRequest(node=NODE, resource_names=["nope"])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.FetchSecrets(missing, timeout=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        no_node = discovery_pb2.DiscoveryRequest(resource_names=["default"])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.FetchSecrets(no_node, timeout=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # One malformed name refuses the call and leaves no lookup of the others waiting.
        bad = discovery_pb2.DiscoveryRequest(
            node=NODE, resource_names=["not-yet", "file-cert:/etc/x.pem~/etc/y.pem"]
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.FetchSecrets(bad, timeout=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await asyncio.sleep(0.05)
        waiting = [t for t in asyncio.all_tasks() if "current" in repr(t.get_coro())]
        assert waiting == []

    run_with_server(sock_dir, None, scenario, fetch_timeout=0.3)


def test_delta_secrets_subscribe_ack_and_push(ca: TestCa, sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = await seeded_cache(ca)
        server.resolver = SecretResolver(cache)
        outgoing: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]:
            while True:
                yield await outgoing.get()

        call = stub.DeltaSecrets(requests())
        outgoing.put_nowait(
            discovery_pb2.DeltaDiscoveryRequest(
                node=NODE, type_url=SECRET_TYPE_URL, resource_names_subscribe=["default"]
            )
        )
        first = await asyncio.wait_for(call.read(), 2)
        assert [r.name for r in first.resources] == ["default"]
        outgoing.put_nowait(discovery_pb2.DeltaDiscoveryRequest(response_nonce=first.nonce))
        await cache.publish(ca.issue("app").tls_secret())
        second = await asyncio.wait_for(call.read(), 2)
        assert second.nonce != first.nonce
        assert second.resources[0].version != first.resources[0].version
        call.cancel()

    run_with_server(sock_dir, None, scenario)


def test_unknown_file_resource_is_refused(sock_dir: Path) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        stream = Stream(stub)
        stream.send(["file-cert:/etc/x.pem~/etc/y.pem"])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream.recv()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "file-mounted" in (info.value.details() or "")
        stream.close()

    run_with_server(sock_dir, None, scenario)


class _BrokenSource:
    """A secret source whose iterator fails (a bug, or e.g. no inotify watches left)."""

    async def _fail(self) -> AsyncIterator[Any]:
        raise RuntimeError("source broke")
        yield  # pragma: no cover - makes this an async generator

    def updates(self, name: str) -> AsyncIterator[Any]:
        return self._fail()


def test_a_failing_source_ends_the_stream_instead_of_leaving_it_silent(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        server.resolver = SecretResolver(_BrokenSource())
        stream = Stream(stub)
        with caplog.at_level(logging.ERROR, logger="agent.sds"):
            stream.send(["default"])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.recv(10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "source broke" in (info.value.details() or "")
        assert "source broke" in caplog.text
        stream.close()

    run_with_server(sock_dir, None, scenario)


def test_two_hundred_streams_all_get_a_rotation_without_threads(ca: TestCa, sock_dir: Path) -> None:
    count = 200

    async def scenario(server: SdsServer, stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
        cache = await seeded_cache(ca)
        server.resolver = SecretResolver(cache)
        threads_before = threading.active_count()
        streams = [Stream(stub) for _ in range(count)]
        for stream in streams:
            stream.send(["default"])
        await asyncio.gather(*(stream.recv(15) for stream in streams))
        for stream in streams:
            stream.ack(["default"])
        assert server.stream_count == count
        # Streams are asyncio tasks: opening 200 of them must not add a thread per stream.
        assert threading.active_count() - threads_before < 10
        rotated = ca.issue("app")
        started = time.monotonic()
        await cache.publish(rotated.tls_secret())
        pushed = await asyncio.gather(*(stream.recv(15) for stream in streams))
        elapsed = time.monotonic() - started
        for response in pushed:
            chain = secrets_of(response)["default"].tls_certificate.certificate_chain
            assert chain.inline_bytes == rotated.cert_pem.encode()
        assert elapsed < 10, f"rotation push to {count} streams took {elapsed:.2f}s"
        for stream in streams:
            stream.close()

    run_with_server(sock_dir, None, scenario)


def test_socket_mode_parent_dir_and_removal(sock_dir: Path) -> None:
    async def main() -> None:
        path = sock_dir / "nested" / "sds.sock"
        server = SdsServer(SecretCache(), path, socket_mode=0o660)
        await server.start()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        await server.stop(0)
        assert not path.exists()

        default = SdsServer(SecretCache(), path)
        await default.start()
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        await default.stop(0)

    asyncio.run(main())


def test_socket_path_length_is_checked() -> None:
    with pytest.raises(ValueError, match="107 bytes"):
        SdsServer(SecretCache(), "/tmp/" + "x" * 120)
