"""The agent failing by accident: its clock jumping forwards and backwards (injected `Clock`),
and its output directory unwritable (a real read-only tmpfs). In-process agent, real gRPC to
an in-process TLS CA, certificates observed the way Envoy sees them: over SDS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import jwt
import pytest
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.config import AgentConfig
from agent.main import Agent
from certs import load_cert
from meshca.clock import FakeClock
from tests.hostile.test_faults_ca import small_tmpfs
from tests.support.agent_process import AgentProcess
from tests.support.agent_wiring import until
from tests.support.ca_process import CaProcess
from tests.support.fake_ca import FakeCaServicer, start_fake_ca
from tests.support.pki import TestCa
from tests.support.processes import http_status, stop_child
from tests.support.sds_client import fetch_secrets

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


async def served(socket: Path) -> x509.Certificate:
    """The leaf Envoy would get for `default` right now."""
    secrets = await asyncio.to_thread(fetch_secrets, socket, ["default"])
    chain = secrets["default"].tls_certificate.certificate_chain.inline_bytes
    return load_cert(chain)


async def _agent(
    tmp: Path, clock: FakeClock, **config: object
) -> tuple[Agent, FakeCaServicer, object]:
    ca = FakeCaServicer(TestCa(clock.now() - timedelta(days=2)), clock)
    server, addr = await start_fake_ca(ca, tmp, clock.now())
    token = tmp / "token"
    token.write_text(jwt.encode({"sub": "system:serviceaccount:shop:cart"}, "k" * 32))
    agent = Agent(
        AgentConfig(
            ca_addr=addr,
            ca_root_ca=tmp / "root-cert.pem",
            token_path=token,
            sds_socket=tmp / "sds" / "socket",
            status_port=0,
            secret_ttl=timedelta(hours=1),
            **config,  # type: ignore[arg-type]
        ),
        clock=clock,
    )
    await agent.start()
    return agent, ca, server


def test_clock_jumps_forwards_and_backwards(tmp_path: Path) -> None:
    """Forward past the rotation point: one renewal. Forward past expiry: renewed, still
    ready. Backward by six hours: the agent keeps serving and does not storm the CA; when time
    catches up again, it renews at the rotation point as before."""

    async def main(tmp: Path) -> None:
        clock = FakeClock(datetime.now(UTC).replace(microsecond=0))
        agent, ca, server = await _agent(tmp, clock)
        socket = tmp / "sds" / "socket"
        ready = f"{agent.status.url}/healthz/ready"
        try:
            await until(lambda: len(ca.metadata) == 1)
            first = await served(socket)

            clock.advance(timedelta(minutes=32))  # past 50 % (+ 1 % jitter) of 1 h
            await until(lambda: len(ca.metadata) == 2)
            second = await _changed(socket, first)
            assert second.not_valid_after_utc > clock.now()

            clock.advance(timedelta(hours=3))  # far past the certificate's expiry
            await until(lambda: len(ca.metadata) == 3)
            third = await _changed(socket, second)
            assert third.not_valid_after_utc > clock.now()
            assert await asyncio.to_thread(http_status, ready) == 200

            clock.advance(timedelta(hours=-6))  # NTP fixes a clock that ran far ahead
            await asyncio.sleep(1.0)  # real time: a renewal loop would show up here
            assert len(ca.metadata) <= 4, f"{len(ca.metadata) - 3} CA calls after the jump"
            now_serving = await served(socket)
            renewed = len(ca.metadata) == 4
            assert renewed or now_serving.serial_number == third.serial_number
            assert agent.failure is None
            calls = len(ca.metadata)

            clock.advance(timedelta(hours=6, minutes=40))  # back past the rotation point
            await until(lambda: len(ca.metadata) == calls + 1)
            await _changed(socket, now_serving)
            assert await asyncio.to_thread(http_status, ready) == 200
        finally:
            await agent.stop()
            await server.stop(None)  # type: ignore[attr-defined]

    asyncio.run(main(tmp_path))


async def _changed(socket: Path, before: x509.Certificate) -> x509.Certificate:
    deadline = time.monotonic() + 10
    while True:
        current = await served(socket)
        if current.serial_number != before.serial_number:
            return current
        if time.monotonic() > deadline:
            raise AssertionError("SDS still serves the previous certificate")
        await asyncio.sleep(0.05)


def test_an_unwritable_output_dir_does_not_stop_sds_and_files_catch_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The files are a convenience; SDS is the contract. A read-only output directory is
    logged and the agent keeps serving over SDS; once writable, the next rotation writes."""
    with tempfile.TemporaryDirectory(prefix="ho", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        with small_tmpfs(tmp / "out") as out:
            subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True)

            async def main() -> None:
                clock = FakeClock(datetime.now(UTC).replace(microsecond=0))
                agent, ca, server = await _agent(tmp, clock, output_certs=out)
                try:
                    await until(lambda: len(ca.metadata) == 1)
                    first = await served(tmp / "sds" / "socket")
                    assert list(out.iterdir()) == []
                    assert "could not write certificates" in caplog.text
                    assert "Read-only file system" in caplog.text
                    status = await asyncio.to_thread(
                        http_status, f"{agent.status.url}/healthz/ready"
                    )
                    assert status == 200
                    subprocess.run(["mount", "-o", "remount,rw", str(out)], check=True)
                    clock.advance(timedelta(minutes=32))
                    second = await _changed(tmp / "sds" / "socket", first)
                    await until(lambda: (out / "cert-chain.pem").exists())
                    on_disk = load_cert((out / "cert-chain.pem").read_bytes())
                    assert on_disk.serial_number == second.serial_number
                finally:
                    await agent.stop()
                    await server.stop(None)  # type: ignore[attr-defined]

            asyncio.run(main())


def test_a_real_agent_asked_for_a_fifo_keeps_serving_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The process-level view of issue #11 item 6: before, `open()` on the FIFO blocked the
    agent's loop, so other SDS clients timed out, /healthz/ready still said ready, and SIGTERM
    (handled on the loop) did nothing until SIGKILL."""
    ca = CaProcess(tmp_path / "ca")
    ca.start()
    agent = AgentProcess(tmp_path, ca, "app", extra_args=("--file-secret-dirs", str(tmp_path)))
    try:
        agent.start()
        fifo = tmp_path / "cert.pem"
        os.mkfifo(fifo)
        key = tmp_path / "key.pem"
        key.write_text("not read: the certificate is refused first")
        name = f"file-cert:{fifo}~{key}"
        done = threading.Event()

        def hostile_client() -> None:
            def requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
                yield discovery_pb2.DiscoveryRequest(
                    node=base_pb2.Node(id="hostile"), resource_names=[name]
                )
                done.wait(10)

            with grpc.insecure_channel(f"unix:{agent.sds_socket}") as channel:
                stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
                with contextlib.suppress(grpc.RpcError):
                    for _ in stub.StreamSecrets(requests(), timeout=10):
                        pass

        hostile = threading.Thread(target=hostile_client, daemon=True)
        hostile.start()
        time.sleep(0.5)
        started = time.monotonic()
        secrets = fetch_secrets(agent.sds_socket, ["default"])
        assert "default" in secrets and time.monotonic() - started < 2
        assert http_status(f"{agent.status_url}/healthz/ready") == 200
        assert agent.proc is not None
        code = stop_child(agent.proc, signal.SIGTERM, timeout=8)
        assert code == 0, f"the agent did not stop on SIGTERM (exit {code}):\n{agent.log()}"
        assert "not a regular file" in agent.log()
        done.set()
        hostile.join(5)
    finally:
        agent.stop()
        ca.stop()
