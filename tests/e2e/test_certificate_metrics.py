"""The agent's per-certificate series follow every change, read the way Prometheus reads them.

Real `meshca ca` and `meshca agent` processes; each check scrapes `/metrics` and compares with
the certificate the agent has just written to its output directory (or was given as files):
after a rotation, after a restore from disk while the CA is down, and after a file-mounted
reload, the expiry series hold the new certificate's values. (A CA hot reload:
tests/ca_server/authority/test_authority_watch.py; a secret no longer served: tests/agent/
test_secret_status.py and the node-mode test in tests/agent/test_node_agent.py.)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from certs import load_cert
from tests.support.agent_process import AgentProcess
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.pki import TestCa
from tests.support.processes import MeshcaProcess, free_port, http_text, wait_for

pytestmark = pytest.mark.process  # every test runs a CA and an agent

EXPIRY = "meshca_agent_cert_expiry_timestamp_seconds"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="cms-") as path:
        yield Path(path)


def series(exposition: str, name: str, resource: str) -> float | None:
    if f'{name}{{resource_name="{resource}"}}' not in exposition:
        return None
    return sample_value(exposition, name, {"resource_name": resource})


def secrets_of(status_url: str) -> dict[str, dict[str, Any]]:
    document = json.loads(http_text(f"{status_url}/debug/secrets"))
    return {entry["resource_name"]: entry for entry in document["secrets"]}


def test_rotation_and_restore_show_the_new_certificate_at_the_next_scrape(
    short_dir: Path,
) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    rotating = AgentProcess(short_dir / "a", ca, "rotating", secret_ttl="4s")
    restored = AgentProcess(short_dir / "a", ca, "restored", secret_ttl="120s")
    again: AgentProcess | None = None
    try:
        rotating.start()
        restored.start()
        first = rotating.wait_file_leaf()
        wait_for(lambda: rotating.file_serial() != first.serial_number, 15, "a rotation")
        leaf = rotating.wait_file_leaf()
        metrics = rotating.metrics()
        # Not stale: at least the certificate on disk (the board is updated before the files,
        # so a rotation landing between the two reads can only make it newer).
        value = series(metrics, EXPIRY, "default")
        assert value is not None and value >= leaf.not_valid_after_utc.timestamp()
        renewed = series(metrics, "meshca_agent_cert_last_renewal_timestamp_seconds", "default")
        next_rotation = series(
            metrics, "meshca_agent_cert_next_rotation_timestamp_seconds", "default"
        )
        lifetime = series(metrics, "meshca_agent_cert_lifetime_seconds", "default")
        assert renewed is not None and next_rotation is not None and lifetime is not None
        assert renewed < next_rotation < leaf.not_valid_after_utc.timestamp()
        assert 3.0 < lifetime <= 4.0  # from when it arrived, not the backdated NotBefore
        root = load_cert(ca.root_cert_path.read_bytes())
        assert series(metrics, EXPIRY, "ROOTCA") == root.not_valid_after_utc.timestamp()

        # Restart the other agent while the CA is down: it serves its previous certificate.
        kept = restored.wait_file_leaf()
        restored.stop()
        ca.stop()
        again = AgentProcess(short_dir / "a", ca, "restored", secret_ttl="120s")
        again.start()
        metrics = again.metrics()
        assert sample_value(metrics, "meshca_agent_certificate_restores_total") == 1
        assert series(metrics, EXPIRY, "default") == kept.not_valid_after_utc.timestamp()
        assert 0 < series(metrics, "cert_expiry_seconds", "default") <= 120  # type: ignore[operator]
        entry = secrets_of(again.status_url)["default"]
        assert entry["serial"] == f"{kept.serial_number:x}" and entry["status"] == "ACTIVE"
        renewed_at = datetime.fromisoformat(entry["last_renewal"])
        assert kept.not_valid_before_utc < renewed_at <= datetime.now(UTC)
    finally:
        for agent in (rotating, restored, again):
            if agent is not None:
                agent.stop()
        ca.stop()


def test_a_file_mounted_reload_shows_the_new_certificate(short_dir: Path) -> None:
    authority = TestCa(datetime.now(UTC))
    certs_dir = short_dir / "etc" / "certs"
    certs_dir.mkdir(parents=True)

    def write(ttl: timedelta) -> Any:
        issued = authority.issue("app", ttl=ttl)
        for name, content in {
            "cert-chain.pem": issued.cert_pem,
            "key.pem": issued.key_pem,
            "root-cert.pem": authority.root_pem,
        }.items():
            (certs_dir / f".{name}.tmp").write_text(content)
            os.replace(certs_dir / f".{name}.tmp", certs_dir / name)
        return issued.cert

    first = write(timedelta(hours=1))
    status_port = free_port()
    args = [
        "agent",
        "--file-mounted-certs",
        "--file-mounted-dir", str(certs_dir),
        "--sds-socket", str(short_dir / "sds.sock"),
        "--status-listen", f"127.0.0.1:{status_port}",
    ]  # fmt: skip
    agent = MeshcaProcess(args, short_dir / "agent.log")
    url = f"http://127.0.0.1:{status_port}"
    agent.start()
    try:

        def expiry() -> float | None:
            try:
                return series(http_text(f"{url}/metrics"), EXPIRY, "default")
            except OSError:
                return None

        wait_for(lambda: expiry() == first.not_valid_after_utc.timestamp(), 15, "first files")
        second = write(timedelta(hours=2))
        wait_for(lambda: expiry() == second.not_valid_after_utc.timestamp(), 5, "the reload")
        entry = secrets_of(url)["default"]
        assert entry["serial"] == f"{second.serial_number:x}"
        assert entry["last_renewal"] is None  # nothing renews file-mounted certificates
    finally:
        agent.stop()
