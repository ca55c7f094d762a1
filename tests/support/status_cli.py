"""Running `meshca status ...` as an operator does (a real subprocess), for tests."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support.processes import child_env


def meshca_status(*args: str) -> subprocess.CompletedProcess[str]:
    """`meshca status ARGS`; the caller checks the exit status."""
    return subprocess.run(
        [sys.executable, "-m", "meshca", "status", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def status_json(*args: str) -> dict[str, Any]:
    """The document `meshca status -o json ARGS` prints (it must succeed)."""
    result = meshca_status("-o", "json", *args)
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document
