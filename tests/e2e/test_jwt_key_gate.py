"""The JWT-SVID key's life on a real `meshca ca` with real `meshca agent`s: activation waits for
the agents that hold a JWT bundle to report holding the prepared key (not one of them is
skipped while it lacks it), and a key that expired while the CA was down is answered with
`UNAVAILABLE` and replaced.

Time is moved the way an operator's tool would see it: the shared key file is rewritten (under
the data directory's lock, by the project's own store) so the active key is past its 5/6 point
and the prepared one has been published longer than the JWKS cache lifetime. The agents, their
reports, the CA's merge of them and its decision are all real.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from spiffe import WorkloadApiClient

from ca_server.authority import Phase
from ca_server.jwt_svid import JwtKeyFactory, JwtKeyState, LocalJwtKeyStore
from meshca.clock import SystemClock
from meshca_proto import jwt_svid_pb2, jwt_svid_pb2_grpc
from tests.support.agent_process import AgentProcess
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.processes import free_port, wait_for
from tests.support.status_cli import status_json

pytestmark = pytest.mark.process

LIFE = timedelta(hours=1)
SHOW_EVERY = 0.3  # seconds between `meshca authority show` runs (each is a Python process)
FACTORY = JwtKeyFactory("ES256", LIFE)


def store(ca: CaProcess) -> LocalJwtKeyStore:
    return LocalJwtKeyStore(ca.data_dir, FACTORY, SystemClock())


def show(ca: CaProcess) -> dict[str, Any]:
    result = meshca_authority(data_dir_target(ca.data_dir), "show", "--jwt", "-o", "json")
    assert result.returncode == 0, result.stderr
    shown: dict[str, Any] = json.loads(result.stdout)
    return shown


def agents_of(ca: CaProcess, kid: str) -> tuple[int, int] | None:
    row = next((k for k in show(ca)["jwt_keys"] if k["kid"] == kid), None)
    if row is None or "agents" not in row:
        return None
    return row["agents"]["holding"], row["agents"]["counted"]


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="jgate-"))
    yield path
    if not os.environ.get("MESHCA_KEEP_TEST_DIRS"):
        shutil.rmtree(path, ignore_errors=True)


def due_with_a_published_prepared_key(state: JwtKeyState) -> JwtKeyState:
    """The active key 52 minutes into its hour (past 5/6: activation due; the coverage gate's
    deadline 3 minutes away) and a prepared key published 10 minutes ago (past the JWKS cache
    lifetime)."""
    now = datetime.now(UTC)
    born = now - timedelta(minutes=52)
    aged = dataclasses.replace(state.active, created_at=born, not_after=born + LIFE)
    prepared = FACTORY.new(now - timedelta(minutes=10), Phase.PREPARED)
    keys = [aged if k is state.active else k for k in state.keys]
    return JwtKeyState((*keys, prepared), state.history)


def status_agents(ca: CaProcess, kid: str) -> tuple[int, int] | None:
    """What `meshca status` of the CA says of `kid`'s coverage (`/debug/ca`)."""
    keys = status_json(ca.debug_address)["jwt_svid"]["keys"]
    row = next((k for k in keys if k["kid"] == kid), None)
    if row is None or "agents" not in row:
        return None
    return row["agents"]["holding"], row["agents"]["counted"]


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one-process", "workers"])
def test_activation_waits_until_every_agent_holding_a_jwt_bundle_holds_the_new_key(
    workdir: Path, starts_processes: None, workers: tuple[str, ...]
):
    """Under `--workers 2` the agents' reports land on either worker: each worker's gate counts
    both workers' (the merged reports), and the supervisor's status shows the same figure."""
    ca = CaProcess(
        workdir / "ca",
        "--ca-reload-interval", "200ms",
        "--jwks-max-age", "2s",
        "--jwt-key-ttl", "1h",
        "--jwt-svid-ttl", "1m",
        "--oidc-listen", f"127.0.0.1:{free_port()}",  # the supervisor's JWT status needs it
        *workers,
    )  # fmt: skip
    ca.start()
    agents = [
        AgentProcess(
            workdir,
            ca,
            name,
            extra_args=(
                "--workload-api-socket",
                f"unix://{workdir / name / 'wl.sock'}",
                "--report-interval",
                "1s",
            ),
        )
        for name in ("fast", "frozen", "idle")
    ]
    fast, frozen, _idle = agents
    stopped = False
    try:
        for agent in agents:
            agent.launch()
        for agent in agents:
            agent.wait_ready()
        first = store(ca).read().active.kid
        for agent in (fast, frozen):  # a workload's first JWT call: the agent holds the bundle
            with WorkloadApiClient(f"unix:{agent.directory / 'wl.sock'}") as client:
                client.fetch_jwt_bundles()
        # `idle` serves no JWT workload: it holds no JWT bundle and is not counted.
        wait_for(lambda: agents_of(ca, first) == (2, 2), 20, "both reporting the key", SHOW_EVERY)

        assert frozen.proc is not None
        os.kill(frozen.proc.pid, signal.SIGSTOP)  # its last report: the first key only
        stopped = True
        store(ca).transact(due_with_a_published_prepared_key)
        prepared = store(ca).read().prepared
        assert prepared is not None
        # `fast` polls its bundle (15 s) and reports it; `frozen` cannot.
        wait_for(lambda: agents_of(ca, prepared.kid) == (1, 2), 30, "one holding it", SHOW_EVERY)
        wait_for(lambda: show(ca)["activation_waiting"], 10, "the gate saying why", SHOW_EVERY)
        wait_for(lambda: status_agents(ca, prepared.kid) == (1, 2), 10, "meshca status", SHOW_EVERY)
        # Noted once, when the gate first held it (before or after `fast` caught up).
        assert re.search(r"[01]/2 reporting agents hold it", show(ca)["activation_waiting"])
        state = store(ca).read()
        assert state.active.kid == first  # still not signing
        assert state.prepared is not None and state.prepared.kid == prepared.kid
        assert jwt.get_unverified_header(_token(ca))["kid"] == first

        os.kill(frozen.proc.pid, signal.SIGCONT)
        stopped = False
        wait_for(lambda: store(ca).read().active.kid == prepared.kid, 40, "the activation")
        activated = next(e for e in store(ca).read().history if e.event == "activated"
                         and e.kid == prepared.kid)  # fmt: skip
        assert "2/2 reporting agents hold it" in activated.reason
        assert jwt.get_unverified_header(_token(ca))["kid"] == prepared.kid
    finally:
        if stopped and frozen.proc is not None:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        for agent in agents:
            agent.stop()
        ca.stop()
    assert "Traceback" not in ca.log()


def _token(ca: CaProcess) -> str:
    """One JWT-SVID straight from the CA's RPC (raises `grpc.RpcError` when refused)."""
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.root_cert_path.read_bytes())
    target = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(ca.addr, credentials, options=target) as channel:
        headers = [("authorization", f"Bearer {ca.mint_token('shop', 'cart')}")]
        request = jwt_svid_pb2.MintJwtSvidRequest(audience=["x"])
        stub = jwt_svid_pb2_grpc.JwtSvidServiceStub(channel)
        return str(stub.MintJwtSvid(request, metadata=headers, timeout=10).token)


def test_a_key_that_expired_while_the_ca_was_down_is_unavailable_then_replaced(
    workdir: Path, starts_processes: None
):
    data = workdir / "ca"
    manual = CaProcess(data, "--no-root-rotation", "--jwt-key-ttl", "1h", "--jwt-svid-ttl", "1m")
    manual.start()
    try:
        expired = datetime.now(UTC) - timedelta(hours=2)

        def down_for_hours(state: JwtKeyState) -> JwtKeyState:
            old = dataclasses.replace(state.active, created_at=expired, not_after=expired + LIFE)
            return JwtKeyState((old,), state.history)

        store(manual).transact(down_for_hours)
        dead = store(manual).read().active.kid
        errors: list[grpc.RpcError] = []

        def refused() -> bool:
            try:
                _token(manual)
            except grpc.RpcError as exc:
                errors.append(exc)
                return True
            return False

        wait_for(refused, 10, "the CA to refuse with the expired key")
        error = errors[-1]
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert dead in (error.details() or "")
        assert "meshca authority prepare --jwt" in (error.details() or "")
        assert manual.running  # the CA keeps serving
    finally:
        manual.stop()
    # The same shared state under automatic rotation: replaced at the first key poll.
    ca = CaProcess(data, "--ca-reload-interval", "200ms", "--jwt-key-ttl", "1h",
                   "--jwt-svid-ttl", "1m")  # fmt: skip
    ca.start()
    try:
        tokens: list[str] = []
        wait_for(lambda: bool(_try_token(ca, tokens)), 10, "a token")
        kid = jwt.get_unverified_header(tokens[0])["kid"]
        state = store(ca).read()
        assert kid == state.active.kid != dead
        assert dead not in [k.kid for k in state.keys]  # expired: it verifies nothing
        reasons = [e.reason for e in state.history if e.kid == kid]
        assert any("activated at once" in reason for reason in reasons), reasons
    finally:
        ca.stop()
    assert "Traceback" not in ca.log() and "Traceback" not in manual.log()


def _try_token(ca: CaProcess, tokens: list[str]) -> bool:
    try:
        tokens.append(_token(ca))
    except grpc.RpcError:
        return False
    return True
