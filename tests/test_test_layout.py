"""The test suite's layout: no test folder imports another.

A file under `tests/<folder>/` imports from its own folder and from `tests/support/` (the
suite's shared library: harnesses, fixtures' machinery, test doubles, the RBAC model) and from
no other test folder; a file directly under `tests/` (the suite-wide `conftest.py`, the layer
tests) imports from `tests/support/` only. What two folders share lives in `tests/support/`,
so a folder can be read, run and moved on its own, and a helper is found where helpers live.

Read from the source with `ast` (nothing imported), so a lazy import inside a function or a
fixture and a relative import (`from ..k8s import conftest`) count too.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from tests.support.source_imports import imported_modules, within

TESTS = Path(__file__).resolve().parent
SHARED = "tests.support"


def crossings(path: str, source: str) -> list[str]:
    """The imports of `source` (the file at `path`, relative to tests/) that reach a test folder
    other than its own and tests/support."""
    parts = PurePosixPath(path).parts
    package = ".".join(["tests", *parts[:-1]])  # what a relative import starts from
    allowed = (SHARED, f"tests.{parts[0]}") if len(parts) > 1 else (SHARED,)
    found = {
        f"tests/{path} imports {name}"
        for name in imported_modules(source, package)
        if within(name, ("tests",)) and name != "tests" and not within(name, allowed)
    }
    return sorted(found)


def test_no_test_folder_imports_another() -> None:
    found = []
    for file in sorted(TESTS.rglob("*.py")):
        path = file.relative_to(TESTS).as_posix()
        found += crossings(path, file.read_text(encoding="utf-8"))
    assert found == [], "share it through tests/support instead:\n" + "\n".join(found)


def test_the_layout_rule_sees_a_crossing() -> None:
    """Planted sources: each way of reaching another folder is found, and what is allowed
    (the own folder, tests/support, absolute or relative) is not."""
    assert crossings("agent/test_x.py", "from tests.hostile.inprocess_ca import good_csr\n") == [
        "tests/agent/test_x.py imports tests.hostile.inprocess_ca",
        "tests/agent/test_x.py imports tests.hostile.inprocess_ca.good_csr",
    ]
    assert crossings("k8s_real/conftest.py", "import tests.deploy.rbac\n") == [
        "tests/k8s_real/conftest.py imports tests.deploy.rbac"
    ]
    lazy = "def fixture():\n    from tests.k8s.conftest import kube_api\n"
    assert "tests/compat/conftest.py imports tests.k8s.conftest" in crossings(
        "compat/conftest.py", lazy
    )
    relative = "from ..k8s import conftest\n"
    assert crossings("compat/conftest.py", relative) == [
        "tests/compat/conftest.py imports tests.k8s",
        "tests/compat/conftest.py imports tests.k8s.conftest",
    ]
    assert crossings("ca_server/kube/test_units.py", "from ...certs import helpers\n") == [
        "tests/ca_server/kube/test_units.py imports tests.certs",
        "tests/ca_server/kube/test_units.py imports tests.certs.helpers",
    ]
    assert crossings("conftest.py", "from tests.k8s.api_calls import CA_RBAC\n") != []
    assert crossings("agent/test_x.py", "from tests.test_layers import within\n") != []
    assert crossings("support/kube_mode.py", "from tests.k8s.conftest import issue\n") != []

    allowed = (
        "from tests.support.pki import TestCa\n"
        "from tests.agent.test_node_agent import fetch_secrets\n"
        "from . import prometheus_operator\n"
        "from .manifests import render\n"
        "from .. import support\n"
        "import tests\n"
        "import json\n"
    )
    assert crossings("agent/test_x.py", allowed) == []
    assert crossings("deploy/test_x.py", "from . import prometheus_operator\n") == []
    assert crossings("ca_server/kube/test_units.py", "from .. import refusal_cases\n") == []
    assert crossings("conftest.py", "from tests.support.process_marker import x\n") == []
