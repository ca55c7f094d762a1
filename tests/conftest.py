"""Suite-wide test selection: the `process` marker.

A test is marked `process` when it starts something outside the test's own thread of control:
a subprocess (the CA, an agent, Envoy, the `meshca` command), or the fake Kubernetes API server.
It is applied here, once, from what the test uses — a fixture that starts one, or a module that
imports a helper that does — so no test can forget it. `pytest -m "not process"` is then the
inner loop (pure and in-process tests only); `make test` runs everything.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import pytest

# Fixtures that start a process or a server (see tests/*/conftest.py).
PROCESS_FIXTURES = frozenset(
    {"ca", "root_pem", "kube_api", "kube_ca", "kube", "control_plane", "real_ca"}
)
# Modules whose use means a test module starts processes.
SPAWNING_MODULES = (
    "subprocess",
    "tests.support.ca_process",
    "tests.support.agent_process",
    "tests.support.authority_cli",
    "tests.support.envoy",
    "tests.support.kube_api",
    "tests.support.real_kube",
    "tests.support.prometheus",
)


def _from_spawning_module(value: object) -> bool:
    name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
    return isinstance(name, str) and any(
        name == spawner or name.startswith(spawner + ".") for spawner in SPAWNING_MODULES
    )


def _module_spawns(module: ModuleType | None, cache: dict[str, bool]) -> bool:
    if module is None:
        return False
    if module.__name__ not in cache:
        cache[module.__name__] = any(
            _from_spawning_module(value)
            for value in vars(module).values()
            if inspect.ismodule(value) or inspect.isclass(value) or inspect.isfunction(value)
        )
    return cache[module.__name__]


def pytest_report_header(config: pytest.Config) -> str:
    """The versions tests/k8s_real runs (pinned in tests/realbin, built by make test)."""
    from tests.support.real_binaries import versions

    return f"real binaries: {versions()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache: dict[str, bool] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if (
            fixtures & PROCESS_FIXTURES
            or item.get_closest_marker("envoy") is not None
            or _module_spawns(getattr(item, "module", None), cache)
        ):
            item.add_marker(pytest.mark.process)


# --- pytest-xdist: the RBAC "every granted rule is used" check across workers -----------------
# Each worker reports, under RBAC_NEEDED_KEY, the rules its Kubernetes tests needed and whether
# it saw a full run of tests/k8s (`tests/k8s/conftest.py`); the controller checks their union.
_WORKER_RBAC_REPORTS: list[dict[str, Any]] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    from tests.k8s.api_calls import RBAC_NEEDED_KEY

    report = getattr(node, "workeroutput", {}).get(RBAC_NEEDED_KEY)
    if report is not None:
        _WORKER_RBAC_REPORTS.append(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _WORKER_RBAC_REPORTS or session.testsfailed:
        return
    if not all(report["full_run"] for report in _WORKER_RBAC_REPORTS):
        return
    from tests.deploy.rbac import Rule
    from tests.k8s.api_calls import CA_RBAC, describe

    needed = {Rule(*rule) for report in _WORKER_RBAC_REPORTS for rule in report["rules"]}
    unused = CA_RBAC - needed
    if unused:
        session.config.get_terminal_writer().line(
            f"\nFAILED tests/k8s: granted but never needed: {describe(unused)}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
