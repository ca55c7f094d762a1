"""The taint notice against a real `meshca agent` process and a real `meshca ca` (issue #28):
what a hostile notice beside `--ca-root` can do to the agent that follows it.

The agent's `--ca-root` is a copy of the CA's bundle in a directory of the test's own, so the
test alone writes the notice beside it (as whoever can edit the `istio-ca-root-cert`
ConfigMap of a namespace can in Kubernetes); the CA's `issued` audit lines count the CSRs the
agent sent. What it shows: a notice whose time overflows, present at start or appearing
later, is refused with one WARNING, the agent gets and keeps its certificate and still follows
the notice; a brief bogus taint of the active authority costs one early re-sign, not one per
report.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.propagation import leaf_authority
from ca_server.authority.slots import authority_id
from certs import load_certs
from meshca.taint_notice import TAINT_NOTICE_NAME, encode_taint_notice
from tests.support.agent_process import AgentProcess
from tests.support.ca_process import CaProcess
from tests.support.csr_audit import issued_lines
from tests.support.metrics import sample_value
from tests.support.processes import wait_for

pytestmark = pytest.mark.process  # a CA and an agent process each

OVERFLOW = "0001-01-01T00:00:00+14:00"  # valid ISO 8601, before year 1 once in UTC


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths must stay under 107 bytes, so not pytest's long tmp_path."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mtn-") as path:
        yield Path(path)


def overflowing_notice(authority: str) -> str:
    return json.dumps({"version": 1, "tainted": [{"authority": authority, "tainted_at": OVERFLOW}]})


def write_notice(path: Path, text: str) -> None:
    """Replaces the notice in one rename, as the CA writes it."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(text)
    os.replace(staged, path)


@contextlib.contextmanager
def ca_and_agent(
    short_dir: Path, notice: Callable[[str], str], *flags: str
) -> Iterator[tuple[CaProcess, AgentProcess, Path]]:
    """A CA and one agent (1 h leaves: no renewal falls due) whose `--ca-root` directory holds
    the CA's bundle and beside it the notice `notice(the CA's active authority)`, in place
    before the agent starts; yields them and the notice's path."""
    ca = CaProcess(short_dir / "data")
    ca.start()
    roots = short_dir / "roots"
    roots.mkdir()
    shutil.copyfile(ca.root_cert_path, roots / "root-cert.pem")
    (root,) = load_certs(ca.root_cert_path.read_bytes())
    notice_path = roots / TAINT_NOTICE_NAME
    write_notice(notice_path, notice(authority_id(root)))
    agent = AgentProcess(
        short_dir, ca, "app", secret_ttl="1h", extra_args=flags, ca_root=roots / "root-cert.pem"
    )
    try:
        agent.start()
        yield ca, agent, notice_path
    finally:
        agent.stop()
        ca.stop()


def no_taints(_active: str) -> str:
    return encode_taint_notice({})


def served_authority(agent: AgentProcess) -> str:
    """The authority that signed the leaf the agent serves (the CA's active one)."""
    authority = leaf_authority(agent.wait_file_leaf())
    assert authority is not None
    return authority


def csrs_signed(ca: CaProcess) -> int:
    return len(issued_lines(ca.log()))


def reports_sent(agent: AgentProcess) -> float:
    return sample_value(agent.metrics(), "meshca_agent_reports_total", {"outcome": "OK"})


def test_an_agent_started_beside_an_overflowing_notice_gets_its_certificate(
    short_dir: Path,
) -> None:
    """Before: `OverflowError` at start, a traceback, exit 1, no certificate (a crash loop).
    The notice names the authority that signs the agent's leaves: read, it would re-sign."""
    with ca_and_agent(short_dir, overflowing_notice) as (ca, agent, _notice):
        leaf = agent.wait_file_leaf()
        time.sleep(2.5)  # a few polls of the notice
        assert agent.running
        log = agent.log()
        assert log.count("ignoring the taint notice") == 1, log
        assert "outside years 1 to 9999 once in UTC" in log
        assert "Traceback" not in log
        assert csrs_signed(ca) == 1  # the refused notice moved nothing
        assert agent.file_leaf() == leaf


def test_an_overflowing_notice_appearing_later_leaves_the_notice_followed(
    short_dir: Path,
) -> None:
    """Before: the notice's poll task died without a log line, and no later notice was read."""
    flags = ("--taint-resign-window", "0s")
    with ca_and_agent(short_dir, no_taints, *flags) as (ca, agent, notice):
        active = served_authority(agent)
        write_notice(notice, overflowing_notice(active))
        wait_for(lambda: "ignoring the taint notice" in agent.log(), 10, "the notice refused")
        assert "outside years 1 to 9999 once in UTC" in agent.log()
        assert csrs_signed(ca) == 1

        # A valid notice after it is still read and acted on: the taint re-signs the leaf.
        write_notice(notice, encode_taint_notice({active: datetime.now(UTC)}))
        wait_for(lambda: csrs_signed(ca) == 2, 10, "the re-sign the valid notice asks for")
        assert agent.running
        log = agent.log()
        assert "(learnt from the taint-notice)" in log
        assert "Traceback" not in log


def test_a_brief_bogus_taint_of_the_active_authority_resigns_at_most_once(
    short_dir: Path,
) -> None:
    """Before: the agent re-signed at every report for the rest of its life ("learnt from the
    report", though the CA's answer named no taint), as the CA kept answering with the
    authority the notice had named."""
    flags = ("--report-interval", "1s", "--taint-resign-window", "1s")
    with ca_and_agent(short_dir, no_taints, *flags) as (ca, agent, notice):
        active = served_authority(agent)
        write_notice(notice, encode_taint_notice({active: datetime.now(UTC)}))
        time.sleep(3.0)
        write_notice(notice, encode_taint_notice({}))  # put back
        after = reports_sent(agent)
        wait_for(lambda: reports_sent(agent) >= after + 6, 20, "six more reports")
        # The first certificate, and the one early re-sign the bogus taint asked for (the CA
        # answered it from the same, active, authority): not one more per report.
        assert csrs_signed(ca) == 2
        assert leaf_authority(agent.wait_file_leaf()) == active
        log = agent.log()
        assert "learnt from the report" not in log
        assert log.count("which the CA has tainted; re-signing in") == 1
        assert agent.running
