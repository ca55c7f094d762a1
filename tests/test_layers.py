"""The import rule between meshca's floors, read from the source with `ast` (nothing imported).

    commands   meshca/cli.py, meshca/__main__.py, meshca/commands/
    daemons    ca_server/   agent/          (never each other, never the commands)
    runtime    meshca/ (the rest: clock, files, logs, status HTTP, informer, kube client, ...)
    library    certs/       (none of the above)

A lower floor importing a higher one (even lazily, inside a function) fails here, so the runtime
stays usable by both daemons and `meshca agent` cannot drag the CA in through a shared helper.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMAND_MODULES = ("meshca.cli", "meshca.__main__", "meshca.commands")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str) -> Iterator[str]:
    """Every module `source` imports, at any depth (top level, functions, TYPE_CHECKING)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def forbidden(module: str) -> tuple[str, ...]:
    """What `module` may not import, by its floor."""
    if within(module, COMMAND_MODULES):
        return ()
    if within(module, ("meshca",)):
        return ("agent", "ca_server", *COMMAND_MODULES)
    if within(module, ("ca_server",)):
        return ("agent", *COMMAND_MODULES)
    if within(module, ("agent",)):
        return ("ca_server", *COMMAND_MODULES)
    if within(module, ("certs",)):
        return ("agent", "ca_server", "meshca")
    raise AssertionError(f"{module} is on no floor")


def violations(module: str, source: str) -> list[str]:
    banned = forbidden(module)
    found = {
        f"{module} imports {name}" for name in imported_modules(source) if within(name, banned)
    }
    return sorted(found)


@pytest.mark.parametrize("package", ["meshca", "ca_server", "agent", "certs"])
def test_no_floor_imports_a_higher_one(package: str):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        found += violations(module_name(path), path.read_text(encoding="utf-8"))
    assert found == []


def test_the_rule_sees_a_lazy_import_from_the_runtime():
    """The checker itself: a function-level import of a daemon from the runtime is caught."""
    source = "import os\n\ndef _late():\n    from ca_server import config\n"
    assert violations("meshca.clock", source) == [
        "meshca.clock imports ca_server",
        "meshca.clock imports ca_server.config",
    ]
    assert violations("meshca.commands.ca", source) == []
    assert violations("agent.main", "import ca_server.kube.mode\n") == [
        "agent.main imports ca_server.kube.mode"
    ]
    assert violations("certs.keys", "from meshca.clock import Clock\n") != []


def test_every_command_is_a_module_of_its_own():
    from meshca.cli import COMMANDS

    for name, (module, _) in COMMANDS.items():
        assert module == f"meshca.commands.{name}"
        assert (ROOT / "meshca" / "commands" / f"{name}.py").is_file()


def test_only_the_completion_queue_server_uses_grpcs_private_core():
    """`grpc._cython` is a private API, pinned and feature-detected in one module
    (`ca_server.serving.cq_server`); nothing else in the product may reach for it."""
    users = [
        module_name(path)
        for package in ("ca_server", "agent", "meshca", "certs")
        for path in sorted((ROOT / package).rglob("*.py"))
        if any(within(m, ("grpc._cython",)) for m in imported_modules(path.read_text()))
    ]
    assert users == ["ca_server.serving.cq_server"]
