"""The agent against a real `meshca ca` process: startup before the CA, a CA outage, a restart
while the CA is down, short-TTL rotation with file readers, and a rejected token. Two tests run
the agent as a `python -m meshca agent` child; the others run it in-process on asyncio."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from agent.config import AgentConfig
from agent.main import Agent
from certs import key_matches_certificate, load_cert, load_private_key
from meshca.clock import SystemClock
from tests.support.agent_process import AgentProcess
from tests.support.agent_wiring import pod_generation
from tests.support.ca_process import CaProcess
from tests.support.processes import MeshcaProcess, free_port, wait_for
from tests.support.sds_client import fetch_secrets, leaf_serial

pytestmark = pytest.mark.process  # every test runs a CA and agents


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths must stay under 107 bytes, so not pytest's long tmp_path."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mca-") as path:
        yield Path(path)


def get(url: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError:
        return None, ""


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def same_address_ca(old: CaProcess) -> CaProcess:
    """A new CA process on the old one's data directory and ports (a CA restart)."""
    new = CaProcess(old.data_dir)
    for flag, port in (("--listen", old.port), ("--monitoring-listen", old.monitoring_port)):
        new.args[new.args.index(flag) + 1] = f"127.0.0.1:{port}"
    new.port, new.monitoring_port = old.port, old.monitoring_port
    return new


def test_cli_agent_starts_before_ca_and_rides_out_an_outage(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    status_port = free_port()
    token = short_dir / "token"
    agent = MeshcaProcess(
        [
            "agent",
            "--ca-addr",
            ca.addr,
            "--ca-root-ca",
            str(ca.root_cert_path),
            "--namespace",
            "default",
            "--service-account",
            "app",
            "--token-path",
            str(token),
            "--sds-socket",
            str(short_dir / "sds" / "socket"),
            "--output-certs",
            str(short_dir / "certs"),
            "--status-listen",
            f"127.0.0.1:{status_port}",
            "--secret-ttl",
            "12s",
        ],
        short_dir / "agent.log",
    )
    ready = f"http://127.0.0.1:{status_port}/healthz/ready"
    metrics = f"http://127.0.0.1:{status_port}/metrics"
    restarted: CaProcess | None = None
    agent.start()
    try:
        # CA not running yet: not ready, and the body says why.
        wait_for(lambda: get(ready)[0] == 503, 15, "the agent's status server")
        assert "not ready" in get(ready)[1]

        ca.start()
        token.write_text(ca.mint_token("default", "app"))
        wait_for(lambda: get(ready)[0] == 200, 20, "the first certificate")
        cert = load_cert((short_dir / "certs" / "cert-chain.pem").read_bytes())
        assert key_matches_certificate(
            load_private_key((short_dir / "certs" / "key.pem").read_bytes()), cert
        )

        # CA goes away; the renewal (due at ~6 s) fails and is retried; the cached cert serves.
        failures = "meshca_agent_rotation_failures_total"
        before = metric(get(metrics)[1], failures)  # startup failures: no CA, no token yet
        ca.stop()
        wait_for(
            lambda: metric(get(metrics)[1], failures) > before,
            15,
            "a failed renewal",
        )
        assert get(ready)[0] == 200
        assert "CA returned UNAVAILABLE" in get(ready)[1]

        restarted = same_address_ca(ca)
        restarted.start()
        wait_for(
            lambda: metric(get(metrics)[1], "meshca_agent_rotations_total") >= 2,
            15,
            "renewal after the CA returned",
        )
        assert get(ready)[0] == 200
        renewed = load_cert((short_dir / "certs" / "cert-chain.pem").read_bytes())
        assert renewed.serial_number != cert.serial_number
    finally:
        code = agent.stop(timeout=5)  # SIGTERM: must exit within 5 s, not be SIGKILLed
        ca.stop()
        if restarted is not None:
            restarted.stop()
    assert code == 0, agent.log()
    assert not (short_dir / "sds" / "socket").exists()
    assert "Bearer" not in agent.log()


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def agent_config(ca: CaProcess, directory: Path, ttl: timedelta) -> AgentConfig:
    return AgentConfig(
        ca_addr=ca.addr,
        ca_root_ca=ca.root_cert_path,
        namespace="default",
        service_account="app",
        secret_ttl=ttl,
        token_path=directory / "token",
        sds_socket=directory / "sds.sock",
        output_certs=directory / "certs",
        status_port=0,
    )


def test_short_ttl_rotates_and_readers_never_see_a_mismatch(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    try:
        (short_dir / "token").write_text(ca.mint_token("default", "app"))
        config = agent_config(ca, short_dir, timedelta(seconds=4))
        files = short_dir / "certs"
        stop = threading.Event()
        checked = [0]
        mismatches: list[str] = []
        serials: set[int] = set()

        def reader() -> None:
            while not stop.is_set():
                try:
                    generation = Path(os.path.realpath(files / "..data"))
                    cert = load_cert((generation / "cert-chain.pem").read_bytes())
                    key = load_private_key((generation / "key.pem").read_bytes())
                except (FileNotFoundError, ValueError):
                    time.sleep(0.001)  # not written yet, or that generation just retired
                    continue
                if not key_matches_certificate(key, cert):
                    mismatches.append(generation.name)
                serials.add(cert.serial_number)
                checked[0] += 1

        async def main() -> None:
            agent = Agent(config, clock=SystemClock())
            await agent.start()
            try:
                await _until(lambda: pod_generation(agent) >= 3, 20, "3 certs")
            finally:
                await agent.stop()

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            asyncio.run(main())
        finally:
            stop.set()
            thread.join(10)
        assert not mismatches
        assert len(serials) >= 3 and checked[0] > 0
    finally:
        ca.stop()


def test_rejected_token_is_reported_and_retried(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    try:
        (short_dir / "token").write_text("not-a-token")
        config = agent_config(ca, short_dir, timedelta(minutes=5))

        async def main() -> None:
            agent = Agent(config, clock=SystemClock())
            await agent.start()
            ready = f"{agent.status.url}/healthz/ready"
            try:
                await _until(
                    lambda: agent.certificates.last_error is not None, 15, "a CA rejection"
                )
                code, body = await asyncio.to_thread(get, ready)
                assert code == 503
                assert "UNAUTHENTICATED" in body
                assert "not-a-token" not in body
                token = await asyncio.to_thread(ca.mint_token, "default", "app")
                (short_dir / "token").write_text(token)
                await _until(lambda: pod_generation(agent) > 0, 20, "retry succeeding")
                assert (await asyncio.to_thread(get, ready))[0] == 200
            finally:
                await agent.stop()

        asyncio.run(main())
    finally:
        ca.stop()


def test_agent_restarted_while_the_ca_is_down_serves_its_previous_certificate(
    short_dir: Path,
) -> None:
    """Agent up with output files; agent stopped; CA stopped; agent started again: ready at
    once with the same serial over SDS and in the files, then a new one when the CA is back."""
    ca = CaProcess(short_dir / "ca")
    ca.start()
    # 30 s: the renewal (at ~15 s) falls after the CA-down checks below, which take a few s.
    agent = AgentProcess(short_dir, ca, "app", secret_ttl="30s")
    restarted: CaProcess | None = None
    try:
        agent.start()
        first = leaf_serial(fetch_secrets(agent.sds_socket, ["default"])["default"])
        assert agent.file_serial() == first
        agent.stop()
        ca.stop()

        agent.start()  # waits for /healthz/ready 200 and the SDS socket, with no CA running
        assert not ca.running
        secrets = fetch_secrets(agent.sds_socket, ["default", "ROOTCA"])
        assert leaf_serial(secrets["default"]) == first
        assert secrets["ROOTCA"].validation_context.trusted_ca.inline_bytes
        assert agent.file_serial() == first
        assert metric(agent.metrics(), "meshca_agent_certificate_restores_total") == 1
        assert metric(agent.metrics(), "meshca_agent_rotations_total") == 0
        assert "restored from" in agent.log()

        restarted = same_address_ca(ca)  # same data dir: same root
        restarted.start()
        wait_for(
            lambda: metric(agent.metrics(), "meshca_agent_rotations_total") >= 1,
            30,
            "a renewal once the CA is back",
        )
        renewed = leaf_serial(fetch_secrets(agent.sds_socket, ["default"])["default"])
        assert renewed != first
        wait_for(lambda: agent.file_serial() == renewed, 5, "the renewed files")
        assert get(f"{agent.status_url}/healthz/ready")[0] == 200
    finally:
        code = agent.stop(timeout=5)
        ca.stop()
        if restarted is not None:
            restarted.stop()
    assert code == 0, agent.log()
    assert "PRIVATE KEY" not in agent.log()
