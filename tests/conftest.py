"""Suite-wide hooks: the `process` marker (tests/support/process_marker.py) and the RBAC check.

A test is marked `process` when it starts a process or the fake Kubernetes API server: through
a fixture that requests `starts_processes`, or by its own `@pytest.mark.process`; an unmarked
test that starts one fails. `pytest -m "not process"` is then the inner loop (every test that
starts nothing); `make test` runs everything.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest_plugins = ["tests.support.process_marker"]
# tests/support holds the suite's shared checks (the in-process CA's `refused`, the Kubernetes
# fixtures): their failed asserts explain themselves as a test's or a conftest's do.
pytest.register_assert_rewrite("tests.support")


def pytest_report_header(config: pytest.Config) -> str:
    """The versions tests/k8s_real runs (pinned in tests/realbin, built by make test)."""
    from tests.support.real_binaries import versions

    return f"real binaries: {versions()}"


# --- pytest-xdist: the RBAC "every granted rule is used" check across workers -----------------
# Each worker reports, under RBAC_NEEDED_KEY, the rules its Kubernetes tests needed and whether
# it saw a full run of tests/k8s (`tests/k8s/conftest.py`); the controller checks their union.
_WORKER_RBAC_REPORTS: list[dict[str, Any]] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    from tests.support.kube_api_calls import RBAC_NEEDED_KEY

    report = getattr(node, "workeroutput", {}).get(RBAC_NEEDED_KEY)
    if report is not None:
        _WORKER_RBAC_REPORTS.append(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _WORKER_RBAC_REPORTS or session.testsfailed:
        return
    if not all(report["full_run"] for report in _WORKER_RBAC_REPORTS):
        return
    from tests.support.deploy_rbac import Rule
    from tests.support.kube_api_calls import CA_RBAC, describe

    needed = {Rule(*rule) for report in _WORKER_RBAC_REPORTS for rule in report["rules"]}
    unused = CA_RBAC - needed
    if unused:
        session.config.get_terminal_writer().line(
            f"\nFAILED tests/k8s: granted but never needed: {describe(unused)}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
