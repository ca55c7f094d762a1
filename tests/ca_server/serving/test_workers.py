"""`meshca ca --workers N`: several real CA processes on one port under one supervisor.

Each test starts its own supervisor on fresh ports; workers are found as the supervisor's
children in /proc, and told apart in the audit lines by their `pid` field.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ca_server.serving.workers import default_worker_count
from certs import SpiffeId, build_csr, generate_private_key, load_cert, private_key_to_pem
from tests.support.authority_cli import authority_rows, data_dir_target, meshca_authority
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.processes import child_env, http_status, wait_for

SLEEP = SpiffeId("cluster.local", "default", "sleep")


def _children(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(child) for child in text.split()}


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status  # a zombie has exited; PID 1 may never reap it here


def _issue_on_new_connections(ca: CaProcess, count: int) -> None:
    """One channel (so one TCP connection) per request: the kernel picks a worker per connection."""
    token = ca.mint_token(SLEEP.namespace, SLEEP.service_account)
    key = generate_private_key()
    for _ in range(count):
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            assert len(create_certificate(stub, build_csr(key, SLEEP), token=token)) >= 2


def _issuing_pids(ca: CaProcess) -> list[int]:
    lines = [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]
    return [int(line["pid"]) for line in lines if line["outcome"] == "issued"]


@pytest.mark.process
def test_two_workers_share_one_port_and_one_metrics_view(tmp_path: Path):
    ca = CaProcess(tmp_path / "data", "--workers", "2")
    ca.start()
    try:
        assert ca.proc is not None
        workers = _children(ca.proc.pid)
        assert len(workers) == 2
        _issue_on_new_connections(ca, 40)
        pids = _issuing_pids(ca)
        assert len(pids) == 40
        assert set(pids) == workers, "both workers must serve the shared port"

        metrics = ca.metrics()
        assert sample_value(metrics, "meshca_ca_certificates_issued_total") == 40
        assert sample_value(metrics, "citadel_server_success_cert_issuance_count") == 40
        assert sample_value(metrics, "citadel_server_csr_count") == 40
        assert sample_value(metrics, "meshca_ca_issuance_latency_seconds_count") == 40
        # One expiry gauge for the whole CA, not one per worker.
        expiry = [
            line
            for line in metrics.splitlines()
            if line.startswith("citadel_server_root_cert_expiry_timestamp")
        ]
        assert len(expiry) == 1 and float(expiry[0].split()[-1]) > time.time()
    finally:
        ca.stop()


@pytest.mark.process
def test_a_killed_worker_is_replaced_and_counts_survive(tmp_path: Path):
    ca = CaProcess(tmp_path / "data", "--workers", "2")
    ca.start()
    try:
        assert ca.proc is not None
        _issue_on_new_connections(ca, 6)
        supervisor = ca.proc.pid
        first = _children(supervisor)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: http_status(f"{ca.monitoring_url}/ready") == 503, 5, "/ready to drop")
        wait_for(
            lambda: (
                len(_children(supervisor) - first) == 1
                and http_status(f"{ca.monitoring_url}/ready") == 200
            ),
            20,
            "a replacement worker serving",
        )
        assert "exited with status -9; restarting it" in ca.log()
        _issue_on_new_connections(ca, 6)
        # The dead worker's issuances stay counted.
        assert sample_value(ca.metrics(), "citadel_server_success_cert_issuance_count") == 12
    finally:
        ca.stop()


@pytest.mark.process
def test_sigterm_stops_the_supervisor_and_every_worker(tmp_path: Path):
    ca = CaProcess(tmp_path / "data", "--workers", "2")
    ca.start()
    assert ca.proc is not None
    workers = _children(ca.proc.pid)
    started = time.monotonic()
    assert ca.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 6, "SIGTERM must stop the supervisor within seconds"
    assert not any(_alive(pid) for pid in workers)


@pytest.mark.process
def test_a_worker_that_cannot_start_stops_the_supervisor_with_its_status(tmp_path: Path):
    (tmp_path / "cacerts").mkdir()
    (tmp_path / "cacerts" / "ca-cert.pem").write_text("incomplete")
    ca = CaProcess(tmp_path / "data", "--workers", "2", "--cacerts-dir", str(tmp_path / "cacerts"))
    ca.launch()
    assert ca.proc is not None
    assert ca.proc.wait(30) == 2
    assert "before serving; stopping" in ca.log()


@pytest.mark.process
def test_workers_do_not_outlive_a_killed_supervisor(tmp_path: Path):
    ca = CaProcess(tmp_path / "data", "--workers", "2")
    ca.start()
    assert ca.proc is not None
    workers = _children(ca.proc.pid)
    ca.kill()
    wait_for(lambda: not any(_alive(pid) for pid in workers), 10, "orphaned workers to exit")


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of `pid`."""
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.process
def test_every_thread_of_the_supervisor_and_its_workers_runs_under_sched_batch(tmp_path: Path):
    ca = CaProcess(tmp_path / "data", "--workers", "2")
    ca.start()
    try:
        assert ca.proc is not None
        _issue_on_new_connections(ca, 4)  # gRPC's threads exist once requests were served
        workers = _children(ca.proc.pid)
        assert len(workers) == 2
        for pid in (ca.proc.pid, *workers):
            assert len(os.listdir(f"/proc/{pid}/task")) > 1
            assert _policies(pid) == {os.SCHED_BATCH}, pid
    finally:
        ca.stop()


@pytest.mark.process
def test_cpu_scheduling_normal_leaves_the_default_policy(tmp_path: Path):
    ca = CaProcess(tmp_path / "data", "--cpu-scheduling", "normal")
    ca.start()
    try:
        assert ca.proc is not None
        _issue_on_new_connections(ca, 2)
        assert _policies(ca.proc.pid) == {os.SCHED_OTHER}
    finally:
        ca.stop()


def test_the_default_worker_count_respects_a_container_cpu_limit(tmp_path: Path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cpu.max").write_text("150000 100000\n")  # limit: 1.5 CPUs
    assert default_worker_count(tmp_path / "v2") == min(affinity, 1)
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    assert default_worker_count(tmp_path / "v2") == affinity
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert default_worker_count(tmp_path / "v1") == min(affinity, 4)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert default_worker_count(tmp_path / "v1") == affinity
    assert default_worker_count(tmp_path / "absent") == affinity


@pytest.mark.process
def test_workers_share_a_port_0_and_the_mtls_port(tmp_path: Path):
    """Port 0 is resolved once by the supervisor, so both workers serve the same port; the
    mTLS renewal port is shared the same way."""
    ca = CaProcess(tmp_path / "data", "--workers", "2", "--mtls-listen", "127.0.0.1:0")
    ca.start()
    try:
        assert ca.proc is not None
        match = re.search(r"supervising 2 CA workers on \S+ and (127\.0\.0\.1:\d+)", ca.log())
        assert match, ca.log()
        mtls_addr = match.group(1)
        token = ca.mint_token(SLEEP.namespace, SLEEP.service_account)
        root = ca.root_cert_path.read_bytes()
        key = generate_private_key()
        with ca_stub(ca.addr, root) as stub:
            chain = create_certificate(stub, build_csr(key, SLEEP), token=token)
        before = len(_issuing_pids(ca))
        for _ in range(20):
            with ca_stub(
                mtls_addr,
                root,
                client_key_pem=private_key_to_pem(key),
                client_chain_pem=chain[0].encode(),
            ) as stub:
                create_certificate(stub, build_csr(generate_private_key(), SLEEP))
        renewals = _issuing_pids(ca)[before:]
        assert len(renewals) == 20
        assert set(renewals) == _children(ca.proc.pid), "both workers serve the mTLS port"
    finally:
        ca.stop()


def _debug_ca(ca: CaProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"{ca.debug_url}/debug/ca", timeout=5) as response:
        document: dict[str, Any] = json.loads(response.read())
    return document


def _latest_leaves(document: dict[str, Any]) -> dict[str, str]:
    return {leaf["identity"]: leaf["serial"] for leaf in document["soonest_expiring_leaves"]}


def _issue_for_identities(ca: CaProcess, accounts: list[str], rounds: int) -> dict[str, str]:
    """`rounds` leaves per account, each on a new connection (so spread over the workers); the
    serial of each identity's last leaf, which is the one `/debug/ca` must show."""
    latest: dict[str, str] = {}
    key = generate_private_key()
    for _ in range(rounds):
        for account in accounts:
            identity = SpiffeId("cluster.local", "default", account)
            token = ca.mint_token(identity.namespace, identity.service_account)
            with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
                chain = create_certificate(stub, build_csr(key, identity), token=token)
            latest[identity.uri] = f"{load_cert(chain[0].encode()).serial_number:x}"
    return latest


@pytest.mark.process
def test_debug_ca_and_meshca_status_cover_every_worker(tmp_path: Path):
    ca = CaProcess(tmp_path / "data", "--workers", "2")
    ca.start()
    try:
        assert ca.proc is not None
        root = load_cert(ca.root_cert_path.read_bytes())
        accounts = [f"svc-{i}" for i in range(5)]
        latest = _issue_for_identities(ca, accounts, 4)
        assert set(_issuing_pids(ca)) == _children(ca.proc.pid), "both workers must issue"

        # Each worker publishes within about a second of issuing.
        wait_for(lambda: _latest_leaves(_debug_ca(ca)) == latest, 10, "every worker's leaves")
        document = _debug_ca(ca)
        assert document["kind"] == "ca" and document["workers_reporting"] == 2
        assert document["leaves_known"] == len(accounts)
        assert document["certificates"][0]["role"] == "signing"
        assert document["certificates"][0]["serial"] == f"{root.serial_number:x}"
        assert document["root_not_after"] == root.not_valid_after_utc.isoformat()
        not_afters = [leaf["not_after"] for leaf in document["soonest_expiring_leaves"]]
        assert not_afters == sorted(not_afters)

        status = subprocess.run(
            [sys.executable, "-m", "meshca", "status", "-o", "json", ca.debug_url],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["kind"] == "ca" and _latest_leaves(shown) == latest
        assert shown["rates"]["issued"]["total"] == 4 * len(accounts)

        # A killed worker's replacement publishes too; what the dead one knew is gone with it.
        supervisor = ca.proc.pid
        first = _children(supervisor)
        os.kill(min(first), signal.SIGKILL)
        wait_for(
            lambda: (
                len(_children(supervisor) - first) == 1
                and http_status(f"{ca.monitoring_url}/ready") == 200
            ),
            20,
            "a replacement worker serving",
        )
        assert http_status(f"{ca.debug_url}/debug/ca") == 200
        more = _issue_for_identities(ca, ["after-restart-0", "after-restart-1"], 3)
        wait_for(
            lambda: more.items() <= _latest_leaves(_debug_ca(ca)).items(),
            10,
            "leaves issued after the restart",
        )
        document = _debug_ca(ca)
        assert document["workers_reporting"] == 2
        assert document["certificates"][0]["serial"] == f"{root.serial_number:x}"
    finally:
        ca.stop()


def _series_of(exposition: str, authority: str) -> list[str]:
    """The sample lines of `/metrics` labelled with `authority`."""
    return [line for line in exposition.splitlines() if f'authority="{authority}"' in line]


@pytest.mark.process
def test_a_revoked_authority_leaves_the_supervisors_metrics(tmp_path: Path):
    """prometheus-client cannot remove a labelled series in multiprocess mode: a worker's file
    keeps its last value. A revoked (or dropped) authority's gauges must still disappear from
    the one `/metrics` view, or `MeshcaCaTaintedAuthorityTrusted` fires forever after the
    revoke its runbook asks for."""
    ca = CaProcess(tmp_path / "data", "--workers", "2", "--ca-reload-interval", "200ms")
    ca.start()
    try:
        target = data_dir_target(ca.data_dir)
        old = authority_rows(target)[0]["id"]
        assert meshca_authority(target, "prepare").returncode == 0
        new = next(row["id"] for row in authority_rows(target) if row["state"] == "prepared")
        assert meshca_authority(target, "activate", new).returncode == 0
        assert meshca_authority(target, "taint", old).returncode == 0
        wait_for(
            lambda: (
                sample_value(ca.metrics(), "meshca_ca_authority_tainted", {"authority": old}) == 1
            ),
            10,
            "the taint in the supervisor's /metrics",
        )
        assert meshca_authority(target, "revoke", old).returncode == 0
        wait_for(
            lambda: not _series_of(ca.metrics(), old),
            10,
            "no series of the revoked authority",
        )
        text = ca.metrics()
        assert (
            sample_value(text, "meshca_ca_authority_phase", {"authority": new, "phase": "active"})
            == 1
        )
        # The live authority's series stay, zeros included.
        assert any(
            line.startswith("meshca_ca_authority_tainted{") and line.endswith(" 0.0")
            for line in _series_of(text, new)
        ), _series_of(text, new)
    finally:
        ca.stop()
