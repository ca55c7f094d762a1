"""The wired-up Agent (in-process) against an in-process TLS CA: readiness, files, metrics,
and the readiness body naming the last error. Fast; the real-CA tests are in
test_agent_integration.py."""

from __future__ import annotations

import asyncio
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import grpc
import jwt
import pytest

from agent.config import AgentConfig
from agent.main import Agent, AgentFailed
from agent.status import readiness_report
from certs import key_matches_certificate, load_cert, load_private_key
from meshca.clock import SystemClock
from tests.support.agent_wiring import pod_generation, scheduler_of, until
from tests.support.fake_ca import FakeCaServicer, start_fake_ca
from tests.support.pki import TestCa
from tests.support.processes import http_status, http_text


async def status(url: str) -> int | None:
    return await asyncio.to_thread(http_status, url)


def test_agent_end_to_end_with_fake_ca() -> None:
    async def main(tmp: Path) -> None:
        clock = SystemClock()
        ca = FakeCaServicer(TestCa(datetime.now(UTC)), clock)
        server, addr = await start_fake_ca(ca, tmp, clock.now())
        token_path = tmp / "token"
        config = AgentConfig(
            ca_addr=addr,
            ca_root_ca=tmp / "root-cert.pem",
            token_path=token_path,
            sds_socket=tmp / "sds" / "socket",
            output_certs=tmp / "certs",
            status_port=0,
        )
        agent = Agent(config, clock=SystemClock())
        await agent.start()
        try:
            ready = f"{agent.status.url}/healthz/ready"
            await until(lambda: agent.certificates.last_error is not None, timeout=10)
            assert await status(ready) == 503
            body = await asyncio.to_thread(_body, ready)
            assert "does not exist" in body and str(token_path) in body

            # Identity comes from the token's claims when not configured.
            token_path.write_text(jwt.encode({"sub": "system:serviceaccount:shop:cart"}, "k" * 32))
            await until(lambda: pod_generation(agent) > 0, timeout=10)
            assert await status(ready) == 200
            files = tmp / "certs"
            cert = load_cert((files / "cert-chain.pem").read_bytes())
            key = load_private_key((files / "key.pem").read_bytes())
            assert key_matches_certificate(key, cert)
            metrics = await asyncio.to_thread(http_text, f"{agent.status.url}/metrics")
            assert 'num_outgoing_requests{request_type="csr"}' in metrics
            assert 'cert_expiry_seconds{resource_name="default"}' in metrics
            assert "meshca_agent_rotations_total 1.0" in metrics
            assert "meshca_agent_sds_pushes" in metrics

            # A rejected renewal is reported but the agent stays ready on its cached cert.
            ca.abort_with = [(grpc.StatusCode.UNAUTHENTICATED, "token expired")]
            scheduler_of(agent).request_rotation()
            await until(lambda: agent.certificates.last_error is not None, timeout=10)
            assert await status(ready) == 200
            report = readiness_report(agent.certificates, clock.now())[1]
            assert "CA returned UNAUTHENTICATED: token expired" in report
            await until(lambda: pod_generation(agent) == 2, timeout=10)
        finally:
            await agent.stop()
            await server.stop(None)
        assert not config.sds_socket.exists()

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        asyncio.run(main(Path(tmp)))


def _body(url: str) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def test_a_dead_rotation_worker_stops_the_agent_loudly(caplog: pytest.LogCaptureFixture) -> None:
    """Not a silently dead task while the agent keeps serving a certificate it never renews."""

    async def main(tmp: Path) -> None:
        config = AgentConfig(
            ca_addr="127.0.0.1:1",
            ca_root_ca=tmp / "root-cert.pem",
            token_path=tmp / "token",
            sds_socket=tmp / "sds" / "socket",
            status_port=0,
        )
        agent = Agent(config, clock=SystemClock())

        async def broken_run() -> None:
            raise RuntimeError("rotation bug")

        agent.certificates.run = broken_run  # type: ignore[method-assign]
        with pytest.raises(AgentFailed, match="rotation bug"):
            await asyncio.wait_for(agent.run(asyncio.Event()), 10)
        assert not config.sds_socket.exists()
        assert "certificates worker died" in caplog.text

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        asyncio.run(main(Path(tmp)))
