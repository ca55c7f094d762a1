"""The shipped alerts and dashboard against a real Prometheus scraping a real CA and agent.

Prometheus (Debian's package) scrapes both every second and evaluates a copy of
deploy/monitoring/rules/alerts.yaml every second, with every `for:` cut to 2 s so the test runs
in well under 90 s; the expressions are the shipped ones. The agent's certificates live 10 s.
Stopping the CA must take the lifetime, renewal and CA-unreachable alerts through pending to
firing, read through Prometheus's HTTP API, and restarting it must resolve them. Then every
dashboard query must return data from the same Prometheus.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from tests.support.agent_process import AgentProcess
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import wait_for
from tests.support.prometheus import PrometheusProcess, ScrapeTarget
from tests.support.sds_client import stream_and_nack

pytestmark = pytest.mark.process  # runs Prometheus, a CA and an agent

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
OUTAGE_ALERTS = {
    "MeshcaCertificatePastRenewalPoint",
    "MeshcaCertificateRenewalsFailing",
    "MeshcaCertificateNotRenewed",
    "MeshcaCaUnreachable",
}
AGENT_LABELS = {"namespace": "default", "pod": "sleep-7d9f"}
CA_LABELS = {"namespace": "istio-system", "pod": "meshca-0"}
RATE_INTERVAL = "1m"  # what Grafana would put in for $__rate_interval


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths must stay under 107 bytes, so not pytest's long tmp_path."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="prm-") as path:
        yield Path(path)


def fast_rules(directory: Path) -> Path:
    """The shipped rules with every `for:` at 2 s (the expressions untouched)."""
    rules = yaml.safe_load((MONITORING / "rules" / "alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    path = directory / "alerts-fast.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


class AlertLog:
    """Every state each alert was seen in, in order, polled from Prometheus's /api/v1/alerts."""

    def __init__(self, prometheus: PrometheusProcess) -> None:
        self.prometheus = prometheus
        self.seen: dict[str, list[str]] = {}

    def poll(self) -> dict[str, str]:
        states = {a["labels"]["alertname"]: a["state"] for a in self.prometheus.alerts()}
        for name, state in states.items():
            history = self.seen.setdefault(name, [])
            if not history or history[-1] != state:
                history.append(state)
        return states

    def wait(self, done: object, timeout: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.poll()
            if callable(done) and done(states):
                return states
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}; alerts seen: {self.seen}")


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [
        (panel["title"], target["expr"].replace("$__rate_interval", RATE_INTERVAL))
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


@pytest.mark.timeout(150)
def test_alerts_fire_and_resolve_and_every_panel_has_data(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "ca")
    ca.start()
    agent = AgentProcess(short_dir / "agents", ca, "sleep", secret_ttl="10s")
    prometheus: PrometheusProcess | None = None
    try:
        agent.start()
        prometheus = PrometheusProcess(
            [
                ScrapeTarget("meshca-agent", f"127.0.0.1:{agent.status_port}", AGENT_LABELS),
                ScrapeTarget("meshca-ca", f"127.0.0.1:{ca.monitoring_port}", CA_LABELS),
            ],
            [fast_rules(short_dir)],
        )
        prometheus.start()
        wait_for(prometheus.targets_up, 20, "Prometheus to scrape the CA and the agent")
        log = AlertLog(prometheus)
        # Healthy: renewals every ~5 s, nothing pending or firing about them.
        wait_for(lambda: len(prometheus.query("meshca_agent_cert_lifetime_seconds")) == 1, 10, "")
        time.sleep(3)
        assert not OUTAGE_ALERTS & set(log.poll())

        # Envoy rejecting a secret (the panels and MeshcaSdsNack need one).
        stream_and_nack(agent.sds_socket, "default")

        ca.stop()
        log.wait(
            lambda states: all(states.get(name) == "firing" for name in OUTAGE_ALERTS),
            40,
            "the outage alerts to fire while the CA is down",
        )
        for name in OUTAGE_ALERTS:
            assert log.seen[name][:2] == ["pending", "firing"], log.seen
        assert log.poll().get("MeshcaSdsNack") == "firing"  # the NACK above

        ca.start()
        log.wait(
            lambda states: not OUTAGE_ALERTS & set(states),
            45,
            "the outage alerts to resolve once the CA is back",
        )
        assert all(log.seen[name] == ["pending", "firing"] for name in OUTAGE_ALERTS)

        # A refused CSR on the restarted CA (its counters started again from zero).
        with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
            with pytest.raises(grpc.RpcError) as refused:
                create_certificate(stub, "not a CSR", token=ca.mint_token("default", "sleep"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        def empty_panels() -> list[str]:
            return [f"{title}: {q}" for title, q in dashboard_queries() if not prometheus.query(q)]

        try:  # a rate needs two scrapes of the new series
            wait_for(lambda: not empty_panels(), 10, "every dashboard query to return data")
        except TimeoutError:
            pytest.fail("dashboard queries without data:\n" + "\n".join(empty_panels()))
    finally:
        if prometheus is not None:
            prometheus.stop()
        agent.stop()
        ca.stop()
