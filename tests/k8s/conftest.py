"""Fixtures for Kubernetes mode (`tests/support/kube_mode.py`: the fake API server and CA
processes pointed at it), and, after a full run of tests/k8s, the check that every rule the CA
is granted was needed by some test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.kube_api_calls import CA_RBAC, RBAC_NEEDED_KEY, describe
from tests.support.kube_mode import RULES_NEEDED, kube_api, kube_ca

__all__ = ["kube_api", "kube_ca"]  # the fixtures this folder's tests request


def _ran_all_kubernetes_tests(session: pytest.Session) -> bool:
    """True for a full, green run of tests/k8s (no -k/-m filter, no single test picked)."""
    option = session.config.option
    if session.testsfailed or option.keyword or option.markexpr:
        return False
    targets = [str(arg) for arg in session.config.args]
    return not any("::" in t for t in targets) and any(
        t.rstrip("/") in (".", "tests", "tests/k8s") or t.endswith(("/tests", "/tests/k8s"))
        for t in targets
    )


@pytest.fixture(scope="session", autouse=True)
def _every_granted_rule_is_used(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a full run: nothing in `CA_RBAC` (so nothing `deploy/` grants) went unused.

    Under pytest-xdist each worker runs only part of tests/k8s, so a worker hands what its tests
    needed to the controller (`tests/conftest.py` takes the union and checks it there)."""
    yield
    full_run = _ran_all_kubernetes_tests(request.session)
    worker_output = getattr(request.config, "workeroutput", None)
    if worker_output is not None:
        worker_output[RBAC_NEEDED_KEY] = {
            "full_run": full_run,
            "rules": [list(r) for r in RULES_NEEDED],
        }
    elif full_run:
        unused = CA_RBAC - RULES_NEEDED
        assert not unused, f"granted but never needed: {describe(unused)}"
