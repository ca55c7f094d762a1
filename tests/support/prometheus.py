"""A real Prometheus server (Debian's `prometheus` package) for tests, on a free loopback port.

It scrapes the given targets every second and evaluates the given rule files every second; its
TSDB lives in a temporary directory that `stop()` removes. Reads go through its HTTP API, as a
dashboard or Alertmanager would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.processes import free_port, http_status, stop_child, wait_for


@dataclass(frozen=True)
class ScrapeTarget:
    job: str
    address: str  # host:port
    labels: dict[str, str]


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path, "prometheus is missing: `make test` installs Debian's prometheus package"
    return path


class PrometheusProcess:
    def __init__(self, targets: list[ScrapeTarget], rule_files: list[Path]) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="prom-"))
        self.port = free_port()
        config = {
            "global": {
                "scrape_interval": "1s",
                "evaluation_interval": "1s",
                "scrape_timeout": "1s",
            },
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [
                {
                    "job_name": target.job,
                    "static_configs": [{"targets": [target.address], "labels": target.labels}],
                }
                for target in targets
            ],
        }
        self.config_path = self.directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.directory / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
            )
        try:
            wait_for(self._ready, timeout, "Prometheus to be ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log()}")
        return http_status(f"{self.url}/-/ready") == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _api(self, path: str, params: dict[str, str] | None = None) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (or [] when it returns no data)."""
        data = self._api("query", {"query": expr})
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"value": result}]
        return list(result)

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing) with their labels and state."""
        return list(self._api("alerts")["alerts"])

    def targets_up(self) -> bool:
        active = self._api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)
