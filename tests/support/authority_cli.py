"""Running `meshca authority ...` as an operator does (a real subprocess), for tests."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.processes import child_env


def data_dir_target(data_dir: Path) -> tuple[str, ...]:
    return ("--data-dir", str(data_dir))


def cluster_target(kubeconfig: Path, namespace: str) -> tuple[str, ...]:
    return ("--kubeconfig", str(kubeconfig), "--namespace", namespace)


def meshca_authority(target: Sequence[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`meshca authority ARGS TARGET`; the caller checks the exit status."""
    return subprocess.run(
        [sys.executable, "-m", "meshca", "authority", *args, *target],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def authority_rows(target: Sequence[str], *args: str) -> list[dict[str, Any]]:
    """The JSON rows printed after `meshca authority ARGS -o json` (default: `show`)."""
    result = meshca_authority(target, *(args or ("show",)), "-o", "json")
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)["authorities"]
    return rows
