"""`meshca status` against a running agent (its status address and its SDS socket) and a running
CA (real processes), as an operator runs it: the tables, the JSON field by field against the
certificates on disk, and `--watch` in a pseudo-terminal redrawing after a rotation (agent) and
after `meshca authority prepare` (CA). The CA's authority slots and coverage also from a stopped
CA's data directory. Node mode: tests/agent/test_node_agent.py."""

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
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from ca_server.authority.slots import authority_id
from certs import load_cert, load_certs
from certs.bundle import bundle_digest
from meshca.commands.status import CLEAR_SCREEN
from tests.support.agent_process import AgentProcess
from tests.support.agent_reports import report_headers, reporting_csr
from tests.support.authority_cli import authority_rows, data_dir_target, meshca_authority
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import (
    child_env,
    children_get_ctrl_c,
    free_port,
    stop_child,
    wait_for,
)
from tests.support.status_cli import meshca_status, status_json

pytestmark = pytest.mark.process  # every test runs a CA and `meshca status`

AGENT_COLUMNS = [
    "RESOURCE NAME", "TYPE", "STATUS", "VALID CERT", "SERIAL NUMBER", "NOT BEFORE", "NOT AFTER",
    "TIME LEFT", "NEXT ROTATION", "LAST ERROR",
]  # fmt: skip


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sts-") as path:
        yield Path(path)


def test_status_of_an_agent_and_of_a_ca(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    agent = AgentProcess(short_dir / "a", ca, "sleep", secret_ttl="120s")
    try:
        agent.start()
        leaf = agent.wait_file_leaf()
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
        ca_address = ca.debug_address
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


class WatchedStatus:
    """`meshca status --watch ARGS` writing to a pseudo-terminal, as in an operator's terminal;
    `screen` is everything it drew so far."""

    def __init__(self, *args: str) -> None:
        self.screen = ""
        self._master, slave = pty.openpty()
        try:
            with children_get_ctrl_c():
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "meshca", "status", "--watch", "--interval", "300ms",
                     *args],
                    stdin=slave, stdout=slave, stderr=slave, env=child_env(), close_fds=True,
                )  # fmt: skip
        except BaseException:
            os.close(self._master)
            raise
        finally:
            os.close(slave)

    def frames(self) -> list[str]:
        """Every complete redraw (the last one may still be arriving)."""
        return self.screen.split(CLEAR_SCREEN)[1:-1]

    def read_until(self, done: Callable[[], bool], what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not done():
            self._read(0.5)
        assert done(), f"{what}: not seen in\n{self.screen[-4000:]}"

    def _read(self, wait: float) -> None:
        ready, _, _ = select.select([self._master], [], [], wait)
        if ready:
            try:
                self.screen += os.read(self._master, 65536).decode(errors="replace")
            except OSError:  # EIO: the process has exited and closed the terminal
                time.sleep(wait)

    def interrupt(self, timeout: float = 10) -> int:
        """Ctrl-C: the exit status. The terminal keeps being read meanwhile, as a real one is:
        a process blocked writing to a full terminal would otherwise never get to exit."""
        self._process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        while self._process.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        return self._process.wait(0.1)

    def close(self) -> None:
        stop_child(self._process)
        os.close(self._master)


def _default_serials(frames: list[str]) -> list[str]:
    """The `default` row's serial in each redraw."""
    serials = []
    for frame in frames:
        match = re.search(r"^default\s+Cert Chain\s+\S+\s+\S+\s+([0-9a-f]+)\s", frame, re.M)
        if match:
            serials.append(match.group(1))
    return serials


def test_watch_redraws_in_place_after_a_rotation(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    agent = AgentProcess(short_dir / "a", ca, "sleep", secret_ttl="4s")
    watch: WatchedStatus | None = None
    try:
        agent.start()
        watch = WatchedStatus(f"127.0.0.1:{agent.status_port}")
        watch.read_until(lambda: len(set(_default_serials(watch.frames()))) >= 2, "a rotation")
        serials = _default_serials(watch.frames())
        runs = [serial for i, serial in enumerate(serials) if i == 0 or serials[i - 1] != serial]
        assert len(runs) == len(set(runs)), f"a redraw went back to an older serial: {runs}"
        assert watch.interrupt() == 0
    finally:
        if watch is not None:
            watch.close()
        agent.stop()
        ca.stop()


def _slot_row(table: str, ident: str) -> list[str]:
    """The cells of authority `ident`'s row in a status table (columns two spaces apart)."""
    match = re.search(rf"^{ident}\s.*$", table, re.M)
    assert match, f"no row for {ident} in:\n{table}"
    return re.split(r"\s{2,}", match.group(0).strip())


def test_status_of_a_ca_shows_its_authorities_and_coverage(short_dir: Path) -> None:
    """A CA with a prepared authority and a few reporting agents: `meshca status ADDRESS` shows
    the slots exactly as `meshca authority show`, plus coverage; after the CA stops, `meshca
    status --data-dir` shows the same slots from the shared state."""
    ca = CaProcess(short_dir / "ca", "--ca-reload-interval", "200ms")
    ca.start()
    address = ca.debug_address
    try:
        assert meshca_authority(data_dir_target(ca.data_dir), "prepare").returncode == 0
        wait_for(lambda: len(load_certs(ca.root_cert_path.read_bytes())) == 2, 20, "bundle {A, B}")
        by_state = {row["state"]: row["id"] for row in authority_rows(data_dir_target(ca.data_dir))}
        roots = {authority_id(r): r for r in load_certs(ca.root_cert_path.read_bytes())}
        a_id, b_id = by_state["active"], by_state["prepared"]
        a, b = roots[a_id], roots[b_id]
        for n in range(3):  # renewed since the prepare: they serve {A, B}
            reporting_csr(ca, report_headers(f"new-{n}", bundle_digest([a, b]), a_id))
        for n in range(2):  # not yet: {A} only
            reporting_csr(ca, report_headers(f"held-{n}", bundle_digest([a]), a_id))
        reporting_csr(ca, [], account="istio-style")  # no report: unknown, never covered

        def caught_up(document: dict[str, Any]) -> bool:
            rows = {row["id"]: row for row in document["authorities"]}
            return rows[a_id]["live_leaves"] == 6 and rows[a_id]["agents_reporting"] == 5

        wait_for(
            lambda: caught_up(status_json(address)),
            20,
            "the CA's view of the 6 leaves and 5 reports",
        )
        document = status_json(address)
        shown = json.loads(
            meshca_authority(data_dir_target(ca.data_dir), "show", "-o", "json").stdout
        )
        assert document["authorities"] == shown["authorities"]
        assert document["agents_unknown"] == shown["agents_unknown"] == 1
        active, prepared = document["authorities"]
        assert active == {
            "id": a_id,
            "state": "active",
            "tainted": False,
            "not_before": a.not_valid_before_utc.isoformat(),
            "not_after": a.not_valid_after_utc.isoformat(),
            "issuer": a.issuer.rfc4514_string(),
            "live_leaves": 6,
            "agents_trusting": 5,
            "agents_reporting": 5,
            "agents_serving": 5,  # each reporting agent's leaf was just signed by A
            "agents_unseen": 0,
        }
        assert prepared == {
            "id": b_id,
            "state": "prepared",
            "tainted": False,
            "not_before": b.not_valid_before_utc.isoformat(),
            "not_after": b.not_valid_after_utc.isoformat(),
            "issuer": b.issuer.rfc4514_string(),
            "live_leaves": 0,
            "agents_trusting": 3,
            "agents_reporting": 5,
            "agents_serving": 0,
            "agents_unseen": 0,
        }
        assert document["coverage"] == {
            "agents_reporting": 5,
            "agents_unknown": 1,
            "reports_left_out": 0,
            "reports_unreadable": 0,
            "authorities": [
                {"id": a_id, "state": "active", "agents_trusting": 5, "fraction": 1.0},
                {"id": b_id, "state": "prepared", "agents_trusting": 3, "fraction": 0.6},
            ],
        }
        # Who the prepared authority waits on: the two held-back pods, by their agent ids.
        (waiting,) = document["agents"]["authorities"]
        assert waiting["id"] == b_id and waiting["not_trusting"]["count"] == 2
        held = {row["agent_id"] for row in waiting["not_trusting"]["pods"]}
        assert held == {"held-0", "held-1"}
        assert document["rates"]["issued"]["total"] == 6
        assert document["rates"]["refusals"] == []
        identities = {leaf["identity"] for leaf in document["soonest_expiring_leaves"]}
        assert identities == {
            "spiffe://cluster.local/ns/default/sa/sleep",
            "spiffe://cluster.local/ns/default/sa/istio-style",
        }

        table = meshca_status(address)
        assert table.returncode == 0, table.stderr
        header = "ID  STATE  TAINTED  NOT BEFORE  NOT AFTER  LIVE LEAVES  AGENTS  SERVING  ISSUER"
        assert re.search(r"^" + header.replace("  ", r"\s+") + "$", table.stdout, re.M)
        assert _slot_row(table.stdout, a_id)[1:] == [
            "active", "no", a.not_valid_before_utc.isoformat(), a.not_valid_after_utc.isoformat(),
            "6", "5/5", "5", a.issuer.rfc4514_string(),
        ]  # fmt: skip
        assert _slot_row(table.stdout, b_id)[1:] == [
            "prepared", "no", b.not_valid_before_utc.isoformat(), b.not_valid_after_utc.isoformat(),
            "0", "3/5", "0", b.issuer.rfc4514_string(),
        ]  # fmt: skip
        assert "counted as unknown): 1" in table.stdout
        assert "coverage: 5 agents reporting, 1 callers without a report" in table.stdout
        assert re.search(rf"^\s+active\s+{a_id}\s+trusted by 5/5 \(100%\)$", table.stdout, re.M)
        assert re.search(rf"^\s+prepared\s+{b_id}\s+trusted by 3/5 \(60%\)$", table.stdout, re.M)
        assert "rates per second since the CA started" in table.stdout
    finally:
        ca.stop()

    # No CA running: the same slots and figures from what the CA left in its data directory.
    result = meshca_status("--data-dir", str(ca.data_dir), "-o", "json")
    assert result.returncode == 0, result.stderr
    stopped = json.loads(result.stdout)
    assert stopped["kind"] == "ca-state"
    assert str(ca.data_dir) in stopped["source"]
    for field in ("authorities", "agents_unknown", "coverage"):
        assert stopped[field] == document[field], field
    assert "rates" not in stopped and "soonest_expiring_leaves" not in stopped
    table = meshca_status("--data-dir", str(ca.data_dir))
    assert table.returncode == 0, table.stderr
    assert _slot_row(table.stdout, a_id)[1:2] == ["active"]
    assert _slot_row(table.stdout, b_id)[5:7] == ["0", "3/5"]
    assert "rates and leaves are only in a running CA" in table.stdout

    empty = meshca_status("--data-dir", str(short_dir / "nothing-here"))
    assert empty.returncode == 1 and empty.stdout == ""
    assert "there are no self-signed authorities yet" in empty.stderr


def test_watch_shows_a_prepared_authority_appear(short_dir: Path) -> None:
    """`--watch` on a CA with two workers (the supervisor merges their `/debug/ca` parts): the
    authority section gains the prepared slot after `meshca authority prepare`."""
    ca = CaProcess(short_dir / "ca", "--ca-reload-interval", "200ms", "--workers", "2")
    ca.start()
    watch: WatchedStatus | None = None
    try:
        (active,) = authority_rows(data_dir_target(ca.data_dir))
        watch = WatchedStatus(ca.debug_address)
        watch.read_until(lambda: len(watch.frames()) >= 2, "two redraws")
        first = watch.frames()[0]
        assert _slot_row(first, active["id"])[1] == "active"
        assert "prepared" not in first

        prepared = meshca_authority(data_dir_target(ca.data_dir), "prepare")
        assert prepared.returncode == 0, prepared.stderr
        rows = authority_rows(data_dir_target(ca.data_dir))
        new_id = next(row["id"] for row in rows if row["state"] == "prepared")
        shown = re.compile(rf"^{new_id}\s+prepared\s", re.M)
        watch.read_until(
            lambda: any(shown.search(f) for f in watch.frames()), f"the prepared {new_id}"
        )
        last = next(f for f in reversed(watch.frames()) if shown.search(f))
        assert re.search(rf"^\s+prepared\s+{new_id}\s+trusted by 0/0", last, re.M)
        assert "rates per second over the last" in last
        assert watch.interrupt() == 0
    finally:
        if watch is not None:
            watch.close()
        ca.stop()
