"""`meshca status` against a running agent (its status address and its SDS socket) and a running
CA (real processes), as an operator runs it: the tables, the JSON field by field against the
certificates on disk, and `--watch` in a pseudo-terminal redrawing after a rotation. Node mode:
tests/agent/test_node_agent.py."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from certs import load_cert
from meshca.commands.status import CLEAR_SCREEN
from tests.support.agent_process import AgentProcess
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import child_env, free_port, stop_child, wait_for

AGENT_COLUMNS = [
    "RESOURCE NAME", "TYPE", "STATUS", "VALID CERT", "SERIAL NUMBER", "NOT BEFORE", "NOT AFTER",
    "TIME LEFT", "NEXT ROTATION", "LAST ERROR",
]  # fmt: skip


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sts-") as path:
        yield Path(path)


def meshca_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshca", "status", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def current_leaf(agent: AgentProcess) -> Any:
    """The leaf of the output directory's current generation (waiting for the first one: the
    files are written just after the agent reports ready)."""
    wait_for(lambda: agent.file_serial() is not None, 10, "the certificate files")
    generation = Path(os.path.realpath(agent.output_dir / "..data"))
    return load_cert((generation / "cert-chain.pem").read_bytes())


def test_status_of_an_agent_and_of_a_ca(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    agent = AgentProcess(short_dir / "a", ca, "sleep", secret_ttl="120s")
    try:
        agent.start()
        leaf = current_leaf(agent)
        root = load_cert(ca.root_cert_path.read_bytes())
        address = f"127.0.0.1:{agent.status_port}"

        table = meshca_status(address)
        assert table.returncode == 0, table.stderr
        header, *rows = table.stdout.splitlines()
        assert re.split(r"\s{2,}", header.strip()) == AGENT_COLUMNS
        assert [row.split()[0] for row in rows] == ["ROOTCA", "default"]
        assert rows[0].split()[1:4] == ["CA", "ACTIVE", "true"]
        assert rows[1].split()[1:5] == ["Cert", "Chain", "ACTIVE", "true"]
        assert f"{leaf.serial_number:x}" in rows[1] and f"{root.serial_number:x}" in rows[0]

        before = datetime.now(UTC)
        result = meshca_status("-o", "json", address)
        assert result.returncode == 0, result.stderr
        document = json.loads(result.stdout)
        assert document["kind"] == "agent"
        now = datetime.fromisoformat(document["now"])
        assert before <= now <= datetime.now(UTC)
        ca_entry, default = document["secrets"]
        assert ca_entry == {
            "resource_name": "ROOTCA",
            "type": "ca",
            "status": "ACTIVE",
            "valid": True,
            "serial": f"{root.serial_number:x}",
            "not_before": root.not_valid_before_utc.isoformat(),
            "not_after": root.not_valid_after_utc.isoformat(),
            "time_left_seconds": (root.not_valid_after_utc - now).total_seconds(),
            "certificates": 1,
            "lifetime_seconds": (
                root.not_valid_after_utc - root.not_valid_before_utc
            ).total_seconds(),
            "last_renewal": None,
            "next_rotation": None,
            "consecutive_failures": 0,
            "last_error": None,
            "last_error_at": None,
        }
        assert default["resource_name"] == "default"
        assert default["type"] == "cert_chain"
        assert default["status"] == "ACTIVE" and default["valid"] is True
        assert default["serial"] == f"{leaf.serial_number:x}"
        assert default["not_before"] == leaf.not_valid_before_utc.isoformat()
        assert default["not_after"] == leaf.not_valid_after_utc.isoformat()
        assert default["time_left_seconds"] == (leaf.not_valid_after_utc - now).total_seconds()
        assert default["certificates"] == 1
        renewed = datetime.fromisoformat(default["last_renewal"])
        next_rotation = datetime.fromisoformat(default["next_rotation"])
        assert leaf.not_valid_before_utc < renewed <= now
        assert renewed < next_rotation < leaf.not_valid_after_utc
        assert default["lifetime_seconds"] == (leaf.not_valid_after_utc - renewed).total_seconds()
        assert 100 < default["lifetime_seconds"] <= 120
        assert default["consecutive_failures"] == 0
        assert default["last_error"] is None and default["last_error_at"] is None

        # The same agent through its SDS socket, as a proxy sees it: the same certificates.
        result = meshca_status("-o", "json", f"unix:{agent.sds_socket}")
        assert result.returncode == 0, result.stderr
        over_sds = {e["resource_name"]: e for e in json.loads(result.stdout)["secrets"]}
        assert set(over_sds) == {"ROOTCA", "default"}
        for name, entry in (("ROOTCA", ca_entry), ("default", default)):
            for field in ("type", "status", "valid", "serial", "not_before", "not_after"):
                assert over_sds[name][field] == entry[field], (name, field)
            assert over_sds[name]["next_rotation"] is None  # not on the SDS wire
        table = meshca_status(f"unix:{agent.sds_socket}")
        assert table.returncode == 0 and f"{leaf.serial_number:x}" in table.stdout
        assert "PRIVATE KEY" not in table.stdout + result.stdout

        # The CA: one issuance (the agent's), one refusal, and the leaf it knows of.
        token = ca.mint_token("default", "sleep")
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub, pytest.raises(grpc.RpcError):
            create_certificate(stub, "not a CSR", token=token)
        ca_address = f"127.0.0.1:{ca.monitoring_port}"
        result = meshca_status("-o", "json", ca_address)
        assert result.returncode == 0, result.stderr
        document = json.loads(result.stdout)
        assert document["kind"] == "ca"
        (signing,) = document["certificates"]
        assert signing["role"] == "signing" and signing["serial"] == f"{root.serial_number:x}"
        assert signing["not_after"] == root.not_valid_after_utc.isoformat()
        assert document["chain_not_after"] == root.not_valid_after_utc.isoformat()
        assert document["root_not_after"] == root.not_valid_after_utc.isoformat()
        rates = document["rates"]
        assert rates["over"] == "since start"
        assert rates["requests"]["total"] == 2 and rates["issued"]["total"] == 1
        assert rates["issued"]["per_second"] > 0 and rates["in_flight"] == 0
        (refusal,) = rates["refusals"]
        assert refusal["reason"] == "csr-invalid" and refusal["code"] == "INVALID_ARGUMENT"
        assert refusal["total"] == 1 and refusal["per_second"] > 0
        assert document["leaves_known"] == 1
        (known,) = document["soonest_expiring_leaves"]
        assert known["identity"] == agent.identity
        assert known["serial"] == f"{leaf.serial_number:x}"
        assert known["not_after"] == leaf.not_valid_after_utc.isoformat()

        table = meshca_status(ca_address)
        assert table.returncode == 0, table.stderr
        assert re.search(r"^csr-invalid\s+INVALID_ARGUMENT\s+1\s", table.stdout, re.M)
        assert re.search(
            rf"^{re.escape(agent.identity)}\s+{leaf.serial_number:x}\s", table.stdout, re.M
        )
        assert "requests 2 (" in table.stdout and "issued 1 (" in table.stdout
    finally:
        agent.stop()
        ca.stop()


def test_status_says_what_to_fix_when_nothing_answers(short_dir: Path) -> None:
    result = meshca_status(f"127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert "cannot reach http://127.0.0.1:" in result.stderr
    assert result.stdout == ""
    result = meshca_status(f"unix:{short_dir / 'no-such.sock'}")
    assert result.returncode == 1
    assert "is it the agent's SDS socket" in result.stderr


def _default_serials(screen: str) -> list[str]:
    """The `default` row's serial in each full redraw of `screen`."""
    frames = screen.split(CLEAR_SCREEN)[1:]
    serials = []
    for frame in frames[:-1]:  # the last one may still be arriving
        match = re.search(r"^default\s+Cert Chain\s+\S+\s+\S+\s+([0-9a-f]+)\s", frame, re.M)
        if match:
            serials.append(match.group(1))
    return serials


def test_watch_redraws_in_place_after_a_rotation(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    agent = AgentProcess(short_dir / "a", ca, "sleep", secret_ttl="4s")
    master, slave = pty.openpty()
    watch: subprocess.Popen[bytes] | None = None
    try:
        agent.start()
        watch = subprocess.Popen(
            [sys.executable, "-m", "meshca", "status", "--watch", "--interval", "300ms",
             f"127.0.0.1:{agent.status_port}"],
            stdin=slave, stdout=slave, stderr=slave, env=child_env(), close_fds=True,
        )  # fmt: skip
        os.close(slave)
        slave = -1
        screen = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(set(_default_serials(screen))) < 2:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                screen += os.read(master, 65536).decode(errors="replace")
        serials = _default_serials(screen)
        assert len(set(serials)) >= 2, f"no rotation seen in {len(serials)} redraws:\n{screen}"
        runs = [serial for i, serial in enumerate(serials) if i == 0 or serials[i - 1] != serial]
        assert len(runs) == len(set(runs)), f"a redraw went back to an older serial: {runs}"
        watch.send_signal(signal.SIGINT)
        assert watch.wait(10) == 0
    finally:
        if watch is not None:
            stop_child(watch)
        if slave >= 0:
            os.close(slave)
        os.close(master)
        agent.stop()
        ca.stop()
