"""`bench/` is a package whose modules run as `python -m bench.NAME`: each imports (so a module
moved in the product breaks here, not on the next benchmark run), with no `sys.path` prelude,
and reaches the tests only through `tests.support` (never a test folder's own helpers)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT

BENCH = REPO_ROOT / "bench"
MODULES = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("name", MODULES)
def test_a_bench_module_imports_the_product_and_tests_support_only(name: str) -> None:
    path = BENCH / f"{name}.py"
    assert "sys.path" not in path.read_text(), "run as `python -m bench.NAME`: no sys.path edits"
    reaching = {
        module
        for module in _imported(path)
        if module.split(".")[0] == "tests" and not module.startswith("tests.support")
    }
    assert not reaching, f"bench/{name}.py imports test-private helpers: {sorted(reaching)}"
    importlib.import_module(f"bench.{name}")
