"""`file-cert:`/`file-root:` names from a hostile SDS client (issue #11 item 6): special files
never block the loop or get read, sizes are bounded, paths stay inside the allowed
directories, and readiness reports a stuck loop."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.file_mounted import FileResource, FileSecretProvider, FileWatcher
from agent.metrics import AgentMetrics
from agent.sds import SECRET_TYPE_URL, SdsServer, SecretResolver
from agent.secrets import Secret, SecretCache
from agent.status import build_status_server
from meshca.clock import SystemClock
from meshca.loop_heartbeat import LoopHeartbeat
from tests.hostile.loop_stall import longest_stall
from tests.support.loop import LoopThread
from tests.support.pki import TestCa
from tests.support.processes import http_status

T = TypeVar("T")
NODE = base_pb2.Node(id="sidecar~10.0.0.1~app.default~default.svc.cluster.local")


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hf", dir="/tmp") as directory:
        yield Path(directory)


def _request(names: list[str]) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(node=NODE, resource_names=names, type_url=SECRET_TYPE_URL)


async def _subscribe(
    stub: sds_pb2_grpc.SecretDiscoveryServiceStub, names: list[str]
) -> grpc.aio.StreamStreamCall:
    async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        yield _request(names)
        await asyncio.sleep(30)

    return stub.StreamSecrets(requests(), timeout=10)


def _write_pair(ca: TestCa, directory: Path) -> tuple[Path, Path]:
    issued = ca.issue("app")
    cert, key = directory / "cert.pem", directory / "key.pem"
    cert.write_text(issued.cert_pem)
    key.write_text(issued.key_pem)
    return cert, key


def test_a_fifo_named_by_file_cert_does_not_block_other_clients(workdir: Path) -> None:
    """Before: `open()` on the FIFO ran on the loop and blocked it until a writer came; every
    other SDS client timed out. Now the FIFO is refused and the loop keeps serving."""
    ca = TestCa()
    _, key = _write_pair(ca, workdir)
    fifo = workdir / "cert-fifo.pem"
    os.mkfifo(fifo)
    name = f"file-cert:{fifo}~{key}"

    def late_writer() -> None:  # unblocks the old code so the test ends either way
        time.sleep(2)
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        os.close(fd)

    threading.Thread(target=late_writer, daemon=True).start()

    async def scenario() -> tuple[int, str | None]:
        cache = SecretCache()
        await cache.publish(ca.issue("app").tls_secret())
        files = FileSecretProvider(FileWatcher(clock=SystemClock()), allowed_dirs=(workdir,))
        server = SdsServer(SecretResolver(cache, files), workdir / "sds.sock")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
                hostile = await _subscribe(stub, [name])
                await asyncio.sleep(0.2)
                started = time.monotonic()
                other = await _subscribe(stub, ["default"])
                response = await asyncio.wait_for(other.read(), 1.5)
                assert time.monotonic() - started < 1.0
                other.cancel()
                hostile.cancel()
                return len(response.resources), files.watcher.last_error(name)
        finally:
            await server.stop(0)
            await files.stop()

    (served, error), stall = asyncio.run(_with_stall(scenario()))
    assert served == 1
    assert stall < 0.5, f"the loop stalled {stall:.2f}s"
    assert error is not None and "not a regular file (a FIFO)" in error


async def _with_stall(work: Awaitable[T]) -> tuple[T, float]:
    """`work`'s result and the longest loop stall while it ran (re-raising its exception)."""
    outcome, stall = await longest_stall(work)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome, stall


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("/dev/zero", "character device"),
        ("/dev/null", "character device"),
        ("DIR", "directory"),
        ("BIG", "the limit is"),
    ],
    ids=["dev-zero", "dev-null", "a directory", "2 MiB file"],
)
def test_special_and_huge_files_are_refused_and_counted(
    workdir: Path, target: str, fragment: str
) -> None:
    metrics = AgentMetrics(SystemClock())
    if target == "DIR":
        path = workdir / "adir"
        path.mkdir()
    elif target == "BIG":
        path = workdir / "big.pem"
        path.write_bytes(b"A" * (2 * 1024 * 1024))
    else:
        path = Path(target)
    name = f"file-root:{path}"

    async def scenario() -> str | None:
        files = FileSecretProvider(FileWatcher(clock=SystemClock(), metrics=metrics))
        updates = files.updates(name)
        waiting = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0.3)
        assert not waiting.done(), "nothing may be served from a refused file"
        waiting.cancel()
        error = files.watcher.last_error(name)
        await files.stop()
        return error

    error, stall = asyncio.run(_with_stall(scenario()))
    assert error is not None and fragment in error, error
    assert stall < 0.5
    failures = metrics.registry.get_sample_value(
        "meshca_agent_file_reload_failures_total", {"resource_name": name}
    )
    assert failures is not None and failures >= 1  # /dev churns: may be re-read


def _stream_status(socket: Path, name: str) -> tuple[grpc.StatusCode, str]:
    done = threading.Event()

    def requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
        yield _request([name])
        done.wait(5)  # no half-close: the server must answer or refuse

    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        try:
            for _ in stub.StreamSecrets(requests(), timeout=3):
                return grpc.StatusCode.OK, "served"
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        finally:
            done.set()
    return grpc.StatusCode.OK, "ended"


def _path_cases(allowed: Path, outside: Path, output: Path) -> dict[str, str]:
    (allowed / "escape").symlink_to(outside)
    return {
        "outside the allowed dirs": f"file-root:{outside / 'root.pem'}",
        "dot-dot out of an allowed dir": f"file-root:{allowed}/../{outside.name}/root.pem",
        "symlink out of an allowed dir": f"file-root:{allowed / 'escape' / 'root.pem'}",
        "relative path": "file-root:root.pem",
        "key outside, cert inside": f"file-cert:{allowed / 'c.pem'}~{outside / 'key.pem'}",
        "the agent's output dir": f"file-cert:{output / 'cert-chain.pem'}~{output / 'key.pem'}",
    }


PATH_CASES = [
    "outside the allowed dirs",
    "dot-dot out of an allowed dir",
    "symlink out of an allowed dir",
    "relative path",
    "key outside, cert inside",
    "the agent's output dir",
]


@pytest.mark.parametrize("case", PATH_CASES)
def test_paths_outside_the_allow_list_are_refused(workdir: Path, case: str) -> None:
    ca = TestCa()
    allowed, outside = workdir / "allowed", workdir / "outside"
    output = allowed / "out"
    for directory in (allowed, outside, output):
        directory.mkdir()
    (outside / "root.pem").write_text(ca.root_pem)
    _write_pair(ca, output)
    name = _path_cases(allowed, outside, output)[case]
    with LoopThread() as loop:
        files = FileSecretProvider(
            FileWatcher(clock=SystemClock()), allowed_dirs=(allowed,), forbidden_dirs=(output,)
        )
        server = SdsServer(SecretResolver(SecretCache(), files), workdir / "s.sock")
        loop.run(server.start())
        try:
            code, details = _stream_status(workdir / "s.sock", name)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert "file-cert:" in details or "absolute" in details
            assert "BEGIN" not in details
            (allowed / "root.pem").write_text(ca.root_pem)  # an allowed one is served
            code, details = _stream_status(workdir / "s.sock", f"file-root:{allowed}/root.pem")
            assert (code, details) == (grpc.StatusCode.OK, "served")
        finally:
            loop.run(server.stop(0))
            loop.run(files.stop())


def test_readiness_reports_a_stuck_event_loop() -> None:
    """Before: /healthz/ready answered from its own thread and said ready while the loop that
    serves SDS was blocked. Now a loop heartbeat older than `stale_after` makes it 503."""

    class Holding:
        last_error = None

        def has_valid_certificate(self, now: object = None) -> bool:
            return True

    heartbeat = LoopHeartbeat(interval=0.05, stale_after=0.4)
    with LoopThread() as loop:
        beating = asyncio.run_coroutine_threadsafe(heartbeat.run(), loop.loop)
        status = build_status_server(
            "127.0.0.1", 0, Holding(), AgentMetrics(SystemClock()), SystemClock(), heartbeat
        )
        status.start()
        try:
            url = f"{status.url}/healthz/ready"
            time.sleep(0.2)
            assert http_status(url) == 200
            loop.loop.call_soon_threadsafe(time.sleep, 1.5)  # something blocks the loop
            time.sleep(0.8)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url, timeout=2)
            assert refused.value.code == 503
            assert "event loop has not run" in refused.value.read().decode()
            time.sleep(1.0)
            assert http_status(url) == 200, "ready again once the loop turns"
        finally:
            status.stop()
            beating.cancel()
            time.sleep(0.1)  # let the loop process the cancellation before it stops


class _StuckResource(FileResource):
    """A file resource whose read hangs until released, as one on a dead NFS mount does."""

    def load(self, now: datetime) -> Secret:
        _STUCK["calls"] += 1
        _RELEASE.wait(10)
        return TestCa().root_secret(self.name)


_STUCK = {"calls": 0}
_RELEASE = threading.Event()


def test_a_stuck_read_holds_one_thread_not_one_per_resync() -> None:
    """A thread blocked in a read cannot be cancelled; starting another at every resync would
    use up the worker threads the agent needs. While one read is stuck, none is started."""
    resource = _StuckResource("file-root:/stuck/root.pem", (Path("/stuck/root.pem"),))

    async def main() -> tuple[int, str | None, int, str | None]:
        watcher = FileWatcher(clock=SystemClock(), read_timeout=0.2, resync_interval=0.1)
        cache = SecretCache()
        try:
            await watcher.add(resource, cache)  # times out, keeps the read running
            await asyncio.sleep(0.6)  # several resyncs
            calls_while_stuck, error = _STUCK["calls"], watcher.last_error(resource.name)
            _RELEASE.set()
            await asyncio.sleep(0.5)  # the next resync reads again, and succeeds
            return calls_while_stuck, error, _STUCK["calls"], watcher.last_error(resource.name)
        finally:
            await watcher.stop()

    stuck_calls, stuck_error, later_calls, later_error = asyncio.run(main())
    assert stuck_calls == 1
    assert stuck_error is not None and "has still not finished" in stuck_error
    assert later_calls >= 2 and later_error is None
