"""A CA worker's metric values keep their pid instead of asking the kernel on every update
(`ca_server.metrics._use_values_with_a_kept_pid`): still one file per process, a forked child's
counts in its own file, none lost or counted twice in the supervisor's sum."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.processes import child_env

_WORKER = textwrap.dedent(
    """
    import os, sys
    from prometheus_client import values
    from ca_server.metrics import CaMetrics, _process_id

    assert values.ValueClass is not None and values.ValueClass._multiprocess
    metrics = CaMetrics()
    metrics.issued.inc()
    child = os.fork()
    if child == 0:
        assert _process_id() == os.getpid(), "the kept pid was not renewed in the child"
        metrics.issued.inc(5)
        metrics.issuance_latency.observe(0.002)
        os._exit(0)
    os.waitpid(child, 0)
    metrics.issued.inc(2)
    print(os.getpid(), child)
    """
)


@pytest.mark.process  # a Python child that forks
def test_parent_and_forked_child_count_in_their_own_files(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WORKER],
        env=child_env({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    parent, child = done.stdout.split()
    assert {path.name for path in tmp_path.glob("counter_*.db")} == {
        f"counter_{parent}.db",
        f"counter_{child}.db",
    }
    from ca_server.metrics import aggregated_registry

    view = aggregated_registry(tmp_path)
    assert view.get_sample_value("meshca_ca_certificates_issued_total") == 8
    assert view.get_sample_value("meshca_ca_issuance_latency_seconds_count") == 1
