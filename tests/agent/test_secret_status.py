"""The agent's per-certificate series and `/debug/secrets` entries, read from one board.

Pure and in-process: a fake clock, the project's own test PKI, and the real registry scraped
with prometheus_client's exposition (what Prometheus reads)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from prometheus_client import generate_latest

from agent.metrics import AgentMetrics
from agent.secret_status import SecretStatus
from agent.secrets import RootSecret, SecretCache, TlsSecret
from agent.status import secret_entry, secrets_document
from certs import SpiffeId, load_cert
from meshca.clock import FakeClock
from tests.support.metrics import sample_value
from tests.support.pki import TestCa

START = datetime(2030, 1, 1, tzinfo=UTC)
IDENTITY = SpiffeId("cluster.local", "default", "sleep")
PER_CERTIFICATE = (
    "cert_expiry_seconds",
    "meshca_agent_cert_expiry_timestamp_seconds",
    "meshca_agent_cert_lifetime_seconds",
    "meshca_agent_cert_last_renewal_timestamp_seconds",
    "meshca_agent_cert_next_rotation_timestamp_seconds",
    "meshca_agent_cert_consecutive_renewal_failures",
)


def leaf(pki: TestCa, now: datetime, ttl: timedelta, name: str = "default") -> TlsSecret:
    return pki.issue(IDENTITY, ttl=ttl, now=now).tls_secret(name)


def serial_of(secret: TlsSecret) -> str:
    return f"{load_cert(secret.cert_chain_pem.encode()).serial_number:x}"


def scrape(metrics: AgentMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def value(metrics: AgentMetrics, name: str, resource: str) -> float | None:
    text = scrape(metrics)
    if f'{name}{{resource_name="{resource}"}}' not in text:
        return None
    return sample_value(text, name, {"resource_name": resource})


def test_time_left_is_computed_at_scrape_time() -> None:
    clock = FakeClock(START)
    metrics = AgentMetrics(clock)
    pki = TestCa(START)
    secret = leaf(pki, START, timedelta(hours=1))
    metrics.on_secret(secret)
    assert value(metrics, "cert_expiry_seconds", "default") == 3600
    clock.advance(600)  # nothing is told; the next scrape still knows
    assert value(metrics, "cert_expiry_seconds", "default") == 3000
    expiry = (START + timedelta(hours=1)).timestamp()
    assert value(metrics, "meshca_agent_cert_expiry_timestamp_seconds", "default") == expiry


def renewed_hour_long_leaf() -> tuple[FakeClock, AgentMetrics, TestCa]:
    """An agent's metrics after obtaining a one-hour leaf at START, rotation due at 30 min."""
    clock = FakeClock(START)
    metrics = AgentMetrics(clock)
    pki = TestCa(START)
    first = leaf(pki, START, timedelta(hours=1))
    metrics.on_secret(first)
    metrics.secrets.renewed("default", serial_of(first), START, START + timedelta(minutes=30))
    return clock, metrics, pki


def test_rotation_replaces_every_value_and_failures_reset() -> None:
    clock, metrics, pki = renewed_hour_long_leaf()
    # The lifetime counts from when it was obtained, not from the backdated NotBefore.
    assert value(metrics, "meshca_agent_cert_lifetime_seconds", "default") == 3600
    clock.advance(1800)
    for attempt in (1, 2, 3):
        metrics.secrets.renewal_failed("default", "CA unavailable", clock.now())
        got = value(metrics, "meshca_agent_cert_consecutive_renewal_failures", "default")
        assert got == attempt
    assert secret_entry(metrics.secrets.reports()[0], clock.now())["status"] == "FAILING"

    now = clock.now()
    second = leaf(pki, now, timedelta(hours=2))
    metrics.on_secret(second)
    metrics.secrets.renewed("default", serial_of(second), now, now + timedelta(hours=1))
    assert value(metrics, "cert_expiry_seconds", "default") == 7200
    assert value(metrics, "meshca_agent_cert_lifetime_seconds", "default") == 7200
    assert value(metrics, "meshca_agent_cert_last_renewal_timestamp_seconds", "default") == (
        now.timestamp()
    )
    assert value(metrics, "meshca_agent_cert_next_rotation_timestamp_seconds", "default") == (
        (now + timedelta(hours=1)).timestamp()
    )
    assert value(metrics, "meshca_agent_cert_consecutive_renewal_failures", "default") == 0


def test_lifetime_falls_back_to_not_before_for_a_certificate_the_scheduler_did_not_report() -> None:
    """File-mounted secrets, or the instant between a publish and the scheduler's report."""
    _, metrics, pki = renewed_hour_long_leaf()
    metrics.on_secret(leaf(pki, START, timedelta(hours=1)))  # a new serial, not reported yet
    # NotBefore is backdated two minutes by the test PKI (as by the CA).
    assert value(metrics, "meshca_agent_cert_lifetime_seconds", "default") == 3720


def test_a_secret_no_longer_served_has_no_series() -> None:
    async def main() -> None:
        clock = FakeClock(START)
        metrics = AgentMetrics(clock)
        cache = SecretCache()
        cache.add_listener(metrics.on_secret)
        cache.add_removal_listener(metrics.on_secret_removed)
        pki = TestCa(START)
        gone = leaf(pki, START, timedelta(hours=1), name=IDENTITY.uri)
        await cache.publish(RootSecret("ROOTCA", pki.root_pem))
        await cache.publish(gone)
        metrics.secrets.renewed(IDENTITY.uri, serial_of(gone), START, START)
        metrics.secrets.renewal_failed(IDENTITY.uri, "boom", START)
        for name in PER_CERTIFICATE:
            assert value(metrics, name, IDENTITY.uri) is not None, name
        await cache.remove(IDENTITY.uri)
        text = scrape(metrics)
        assert IDENTITY.uri not in text
        assert value(metrics, "cert_expiry_seconds", "ROOTCA") is not None
        assert [r.resource_name for r in metrics.secrets.reports()] == ["ROOTCA"]

    asyncio.run(main())


def test_failures_before_the_first_certificate_are_reported_and_forgotten() -> None:
    board = SecretStatus()
    board.renewal_failed(IDENTITY.uri, "permission denied", START)
    (report,) = board.reports()
    assert report.status(START) == "PENDING" and not report.valid(START)
    entry = secret_entry(report, START)
    assert entry["type"] is None and entry["serial"] is None and entry["time_left_seconds"] is None
    assert entry["consecutive_failures"] == 1 and entry["last_error"] == "permission denied"
    board.forget(IDENTITY.uri)  # the identity left the node before a certificate arrived
    assert board.reports() == []


def test_debug_document_fields() -> None:
    board = SecretStatus()
    pki = TestCa(START)
    secret = leaf(pki, START, timedelta(hours=1))
    board.on_secret(secret)
    board.on_secret(RootSecret("ROOTCA", pki.root_pem))
    board.renewed("default", serial_of(secret), START, START + timedelta(minutes=30))
    now = START + timedelta(minutes=10)
    document = secrets_document(board, now)
    assert document["kind"] == "agent" and document["now"] == now.isoformat()
    root, default = document["secrets"]
    # Every field, checked against real processes: tests/e2e/test_status.py.
    assert root["type"] == "ca" and root["status"] == "ACTIVE" and root["valid"] is True
    assert root["serial"] == f"{pki.root.serial_number:x}" and root["next_rotation"] is None
    assert default["type"] == "cert_chain" and default["serial"] == serial_of(secret)
    assert default["time_left_seconds"] == 3000 and default["lifetime_seconds"] == 3600
    assert default["next_rotation"] == (START + timedelta(minutes=30)).isoformat()
    assert "PRIVATE KEY" not in str(document)
    assert secret_entry(board.reports()[1], START + timedelta(hours=2))["status"] == "EXPIRED"
