"""deploy/monitoring/: the alert rules pass promtool and their unit tests, the PrometheusRule is
the same rules, the monitors point at the ports deploy/ really exposes, and every alert has a
runbook entry. The live check (a real Prometheus scraping a real CA and agent, every dashboard
query returning data) is tests/e2e/test_prometheus.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support.deploy_manifests import DEPLOY_DIR, find, manifests, patch_files, render

from . import prometheus_operator

MONITORING = DEPLOY_DIR / "monitoring"
ALERTS = MONITORING / "rules" / "alerts.yaml"
ALERT_TESTS = MONITORING / "tests" / "alerts_test.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
MONITORING_DOC = DEPLOY_DIR.parent / "docs" / "monitoring.md"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make test` installs Debian's prometheus package"
    return path


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@pytest.mark.process
def test_promtool_accepts_the_rule_file() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


@pytest.mark.process
def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: a rule with a PromQL syntax error is refused."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "rate(x[5m]"}]}]})
    )
    result = subprocess.run(
        [promtool(), "check", "rules", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0


@pytest.mark.process
def test_alert_unit_tests_pass() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    for alert in _alerts():
        assert cases.get(alert["alert"]) == {True, False}, (
            f"{alert['alert']}: needs a promtool case where it fires and one where it does not"
        )


def test_prometheus_rule_holds_the_same_rules() -> None:
    rule = find("PrometheusRule", "meshca", under="monitoring").doc
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text()), (
        "deploy/monitoring/prometheusrule.yaml spec must equal rules/alerts.yaml: edit both"
    )


def test_alerts_are_relative_to_lifetimes_and_have_runbooks() -> None:
    doc = MONITORING_DOC.read_text()
    headings = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in doc.splitlines()
        if line.startswith("### ")
    }
    for alert in _alerts():
        name = alert["alert"]
        assert name.lower() in headings, f"docs/monitoring.md has no '### {name}' runbook"
        assert alert["annotations"]["runbook_url"].endswith(f"#{name.lower()}")
        assert alert["labels"]["severity"] in {"warning", "critical"}
        # No fixed hour/day thresholds: durations appear only as rate windows.
        assert not re.search(r"\d\s*\*\s*(3600|86400)", alert["expr"]), name


def test_monitoring_objects_are_schema_checked_strictly() -> None:
    objects = render(MONITORING)
    assert sorted(o["kind"] for o in objects) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    for obj in objects:
        prometheus_operator.validate(obj)
    pod_monitor = next(o for o in objects if o["kind"] == "PodMonitor")
    typo = {**pod_monitor, "spec": {**pod_monitor["spec"], "podMetricEndpoints": []}}
    with pytest.raises(jsonschema.ValidationError, match="podMetricEndpoints"):
        prometheus_operator.validate(typo)


def test_pod_monitor_scrapes_the_agents_status_port() -> None:
    endpoint = find("PodMonitor", "meshca-agents", under="monitoring").doc["spec"][
        "podMetricsEndpoints"
    ][0]
    patches = patch_files()
    agents = [
        container
        for manifest in manifests()
        if manifest.kind in {"Deployment", "DaemonSet"} and manifest.path.resolve() not in patches
        for container in [
            *manifest.doc["spec"]["template"]["spec"].get("initContainers", []),
            *manifest.doc["spec"]["template"]["spec"]["containers"],
        ]
        if "agent" in container.get("args", [])
    ]
    assert len(agents) >= 2  # the sidecar example and the node agent
    for container in agents:
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert ports.get(endpoint["port"]) == 15020, container["name"]
    assert endpoint["path"] == "/metrics"


def test_service_monitor_selects_the_ca_service_monitoring_port() -> None:
    monitor = find("ServiceMonitor", "meshca-ca", under="monitoring").doc["spec"]
    service = find("Service", "meshca").doc
    labels = service["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert port_names[monitor["endpoints"][0]["port"]] == 15014


def test_dashboard_panels_all_have_queries() -> None:
    """Shape only; tests/e2e/test_prometheus.py runs each query against a live Prometheus."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 8
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${datasource}"
