"""The import rule between meshca's floors, read from the source with `ast` (nothing imported).

    commands   meshca/cli.py, meshca/__main__.py, meshca/commands/
    daemons    ca_server/   agent/          (never each other, never the commands)
    runtime    meshca/ (the rest: clock, files, logs, status HTTP, informer, kube client, ...)
    library    certs/       (none of the above)

A lower floor importing a higher one (even lazily, inside a function) fails here, so the runtime
stays usable by both daemons and `meshca agent` cannot drag the CA in through a shared helper.
Nor may any module of the product reach itself through its imports (an import cycle), however
lazily: a cycle is a module that cannot be read, tested or moved without the others in it.
"""

from __future__ import annotations

import ast
import functools
import io
import itertools
import re
import tokenize
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

from tests.support.source_imports import base_of, imported_modules, within

ROOT = Path(__file__).resolve().parent.parent
COMMAND_MODULES = ("meshca.cli", "meshca.__main__", "meshca.commands")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


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
    """`grpc._cython` is a private API, imported and feature-detected in one module
    (`ca_server.serving.grpc_core`, for the completion-queue server); nothing else in the
    product may reach for it."""
    users = [
        module_name(path)
        for package in ("ca_server", "agent", "meshca", "certs")
        for path in sorted((ROOT / package).rglob("*.py"))
        if any(within(m, ("grpc._cython",)) for m in imported_modules(path.read_text()))
    ]
    assert users == ["ca_server.serving.grpc_core"]


def test_only_the_composition_root_imports_the_rpc_server():
    """Handlers obey `await to_the_loop()` (`ca_server.loop_handoff`) without importing the
    server that needs it: the RPC server is chosen and built in one place (`ca_server.server`);
    the package root names its start-up check for `meshca ca` (imported on first use)."""
    users = [
        module_name(path)
        for package in ("ca_server", "agent", "meshca", "certs")
        for path in sorted((ROOT / package).rglob("*.py"))
        if any(
            within(m, ("ca_server.serving.cq_server",)) for m in imported_modules(path.read_text())
        )
    ]
    assert users == ["ca_server", "ca_server.server"]


# -- the CA's composition root, its wire names and its package root ---------------------------

WIRE_MODULES = ("meshca/wire.py", "ca_server/wire.py")
WIRE_LITERALS = (
    "ImpersonatedIdentity",
    "CertSigner",
    "x-meshca-",
    "grpc-retry-pushback-ms",
    "istiod.istio-system.svc",
    "istio.v1.auth.IstioCertificateService",
    "meshca.v1.AgentReportService",
)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of `tree` (prose may name a header; code may not)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelt_wire_names(source: str) -> list[str]:
    """The wire literals `source` spells in code (string constants, f-string parts), not in
    its docstrings."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    return sorted(
        {
            literal
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            if id(node) not in prose
            for literal in WIRE_LITERALS
            if literal in node.value
        }
    )


def test_server_py_never_asks_which_serving_role_it_has():
    """`ca_server.serving.role` is chosen once (`serving_role_for`); the composition root only
    calls it. A `.worker` read in `server.py` is a branch on worker mode coming back."""
    tree = ast.parse((ROOT / "ca_server" / "server.py").read_text(encoding="utf-8"))
    reads = [
        f"line {node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "worker"
    ]
    assert reads == []


def test_the_check_sees_a_worker_branch():
    source = "def f(config):\n    if config.worker is not None:\n        pass\n"
    tree = ast.parse(source)
    assert any(isinstance(n, ast.Attribute) and n.attr == "worker" for n in ast.walk(tree))


@pytest.mark.parametrize("package", ["meshca", "ca_server", "agent"])
def test_wire_names_are_spelt_only_in_the_wire_modules(package: str):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in WIRE_MODULES:
            continue
        found += [
            f"{path.relative_to(ROOT)}: {name}"
            for name in spelt_wire_names(path.read_text(encoding="utf-8"))
        ]
    assert found == []


def test_the_wire_check_sees_code_and_skips_prose():
    source = (
        '"""Sends `x-meshca-renewal`."""\n'
        'HEADER = "x-meshca-renewal"\n'
        "def f(ms):\n"
        '    """Reads grpc-retry-pushback-ms."""\n'
        '    return f"retry after the grpc-retry-pushback-ms hint {ms}"\n'
    )
    assert spelt_wire_names(source) == ["grpc-retry-pushback-ms", "x-meshca-"]


def test_the_ca_wire_names_the_services_the_protos_define():
    from ca_server import wire
    from meshca_proto import ca_pb2, report_pb2

    assert (
        ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"].full_name
    ) == wire.CERTIFICATE_SERVICE
    assert (
        report_pb2.DESCRIPTOR.services_by_name["AgentReportService"].full_name
    ) == wire.REPORT_SERVICE


@pytest.mark.parametrize("command", ["ca", "token"])
def test_the_ca_and_token_commands_reach_the_ca_through_its_package_root(command: str):
    source = (ROOT / "meshca" / "commands" / f"{command}.py").read_text(encoding="utf-8")
    reached = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            reached |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            reached.add(node.module)
    assert {m for m in reached if within(m, ("ca_server",))} <= {"ca_server", "ca_server.config"}


def _root_imports() -> tuple[list[str], dict[str, str]]:
    """`ca_server/__init__.py`'s imports at run time, and the names it imports for the type
    checker only (name → module)."""
    tree = ast.parse((ROOT / "ca_server" / "__init__.py").read_text(encoding="utf-8"))
    runtime: list[str] = []
    typing_only: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for sub in node.body:
                assert isinstance(sub, ast.ImportFrom) and sub.module
                typing_only |= {alias.name: sub.module for alias in sub.names}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            runtime += list(imported_modules(ast.unparse(node)))
    return runtime, typing_only


def test_the_ca_package_root_loads_nothing_until_asked():
    """`import ca_server.config` (every command's parser) loads the package root: it must not
    load gRPC, the server or the authority with it."""
    runtime, _ = _root_imports()
    assert not [m for m in runtime if within(m, ("ca_server", "grpc", "meshca_proto"))]


def test_the_ca_package_root_exports_what_it_declares():
    import ca_server

    _, typing_only = _root_imports()
    assert typing_only == ca_server._EXPORTS  # what mypy sees is what run time gives
    assert sorted(ca_server.__all__) == sorted(typing_only)
    for name, module in typing_only.items():
        assert getattr(ca_server, name) is getattr(__import__(module, fromlist=[name]), name)
    with pytest.raises(AttributeError):
        _ = ca_server.no_such_export


# -- the CA's facades ------------------------------------------------------------------------
#
#     meshca/commands/   may import from ca_server only: the package root `ca_server`,
#                        `ca_server.authority`, `ca_server.fleet` and `ca_server.jwt_svid`
#                        (the facades) and `ca_server.config`
#     ca_server/authority/<module>   private to the package: the rest of the product reaches it
#                        through `ca_server.authority` only, except `ca_server.kube`, which
#                        implements the package's store and publication protocols in the cluster
#                        and imports the modules that define them (`KUBE_MAY_IMPLEMENT`)
#     ca_server/fleet/<module>   private to the package likewise: the rest of the product
#                        reaches it through `ca_server.fleet` only; the fleet sits below the
#                        authority (the authority reads it) and never imports `ca_server.authority`
#
# Tests and benches may import anything (they test the parts).

COMMAND_FACADES = (
    "ca_server",
    "ca_server.authority",
    "ca_server.fleet",
    "ca_server.config",
    "ca_server.jwt_svid",
)
AUTHORITY = "ca_server.authority"
FLEET = "ca_server.fleet"
KUBE_MAY_IMPLEMENT = tuple(f"{AUTHORITY}.{name}" for name in ("slots", "state_store"))


def imported_from(source: str) -> Iterator[str]:
    """The modules `source` imports from, at any depth: `import a.b` -> a.b; `from a.b import c`
    -> a.b, and a.b.c too when that is a module of this repository (not a name in a.b)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                path = ROOT.joinpath(*name.split("."))
                if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
                    yield name


def facade_violations(module: str, source: str) -> list[str]:
    found = set()
    for name in imported_from(source):
        if within(module, ("meshca.commands",)):
            if within(name, ("ca_server",)) and name not in COMMAND_FACADES:
                found.add(
                    f"{module} imports {name}: use ca_server.authority, ca_server.fleet or "
                    "ca_server.config"
                )
        elif not within(module, (AUTHORITY,)) and within(name, (AUTHORITY,)) and name != AUTHORITY:
            if within(module, ("ca_server.kube",)) and name in KUBE_MAY_IMPLEMENT:
                continue
            found.add(f"{module} imports {name}: import it from the facade ca_server.authority")
        if within(module, (FLEET,)) and within(name, (AUTHORITY,)):
            found.add(f"{module} imports {name}: the fleet is below the authority, never above")
        elif not within(module, (FLEET,)) and within(name, (FLEET,)) and name != FLEET:
            found.add(f"{module} imports {name}: import it from the facade ca_server.fleet")
    return sorted(found)


@pytest.mark.parametrize("package", ["meshca", "ca_server", "agent"])
def test_the_ca_is_reached_through_its_facades(package: str):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        found += facade_violations(module_name(path), path.read_text(encoding="utf-8"))
    assert found == []


def test_the_facade_rule_sees_what_it_must():
    """The checker itself, on sources that break each rule."""
    assert facade_violations("meshca.commands.status", "from ca_server.authority import x\n") == []
    assert facade_violations("meshca.commands.status", "import ca_server.config\n") == []
    assert facade_violations("meshca.commands.status", "from ca_server import authority\n") == []
    assert facade_violations(
        "meshca.commands.status", "def f():\n    from ca_server.kube.clients import c\n"
    ) == [
        "meshca.commands.status imports ca_server.kube.clients: use ca_server.authority, "
        "ca_server.fleet or ca_server.config"
    ]
    assert facade_violations("meshca.commands.authority", "from ca_server import errors\n") != []
    assert facade_violations("ca_server.service", "from ca_server.authority.slots import x\n") != []
    assert facade_violations("ca_server.service", "from ca_server.authority import signer\n") != []
    assert (
        facade_violations(
            "ca_server.authority.plugged", "from ca_server.authority.slots import x\n"
        )
        == []
    )
    assert (
        facade_violations("ca_server.kube.secret_root", "import ca_server.authority.slots\n") == []
    )
    assert (
        facade_violations("ca_server.kube.mode", "import ca_server.authority.self_signed\n") != []
    )


def test_the_facade_rule_keeps_the_fleet_below_the_authority_and_behind_its_facade():
    """The checker itself, on sources that break the fleet's two rules (and on ones that don't)."""
    assert facade_violations("ca_server.fleet.coverage", "import ca_server.authority\n") == [
        "ca_server.fleet.coverage imports ca_server.authority: the fleet is below the authority, "
        "never above"
    ]
    assert (
        facade_violations(
            "ca_server.fleet.merge", "def f():\n    from ca_server.authority.slots import x\n"
        )
        != []
    )
    assert (
        facade_violations("ca_server.fleet.merge", "from ca_server.fleet.entries import x\n") == []
    )
    assert facade_violations("ca_server.authority.slots", "from ca_server.fleet import x\n") == []
    assert (
        facade_violations("ca_server.kube.replica_reports", "from ca_server import fleet\n") == []
    )
    assert facade_violations("ca_server.service", "from ca_server.fleet import entries\n") == [
        "ca_server.service imports ca_server.fleet.entries: import it from the facade "
        "ca_server.fleet"
    ]
    assert facade_violations("ca_server.kube.report_pods", "import ca_server.fleet.merge\n") != []
    assert (
        facade_violations("meshca.commands.authority_view", "from ca_server.fleet import x\n") == []
    )
    assert (
        facade_violations("meshca.commands.status", "from ca_server.fleet.merge import x\n") != []
    )


def identifiers(source: str) -> set[str]:
    """Every name the code uses (variables, attributes, imported names, definitions), lowered;
    docstrings and comments are not code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
    return {name.lower() for name in found}


def test_the_server_does_not_branch_on_the_authority_mode():
    """`ca_server.server` holds an `AuthorityDriver` and never asks which kind: it imports the
    facade, not the drivers, and its code names none of their parts."""
    source = (ROOT / "ca_server" / "server.py").read_text(encoding="utf-8")
    imported = set(imported_from(source))
    assert {name for name in imported if within(name, (AUTHORITY,))} <= {AUTHORITY}
    used = identifiers(source)
    for part in (
        "SlotSigner",
        "RecordingSigner",
        "rotator",
        "guard",
        "cacerts_dir",
        "SelfSignedDriver",
        "PluggedDriver",
        "tainted_since_for",
        "authority_source_for",
        "watch_authority",
    ):
        assert part.lower() not in used, f"ca_server/server.py uses {part}"
    assert "authority_driver_for" in used


def test_the_server_rule_sees_a_branch():
    source = "def f(signer):\n    if isinstance(signer, SlotSigner):\n        pass\n"
    assert {"isinstance", "slotsigner", "signer"} <= identifiers(source)
    assert "rotator" in identifiers("x = setup.rotator\n")
    assert "rotator" not in identifiers('"""the rotator"""\n')


# -- no import cycle anywhere in the product --------------------------------------------------
#
# The graph is read from the source (nothing imported): one node per module of `ca_server/`,
# `agent/`, `certs/` and `meshca/` (a package's `__init__.py` is the package's node), one edge
# per import at any depth (top level, inside functions, under TYPE_CHECKING), absolute or
# relative. `import a.b` is an edge to a.b. `from a.b import c` is an edge to a.b.c when that is
# a module, else to a.b (c is a name a.b defines). How a package's `__init__.py` counts: Python
# runs the parent packages on the way to a module, but that implicit step is no edge (every
# module would otherwise hang off its package root, and `from p import sub` is `import p.sub`);
# taking a name from a package is one. So a module of package P that imports a name from P's
# facade while the facade imports it is a circle, and is reported as one. Anything outside the
# four packages (the standard library, grpc, generated `meshca_proto`) is no node.

PRODUCT_PACKAGES = ("ca_server", "agent", "certs", "meshca")

ImportGraph = dict[str, dict[str, int]]  # module → {module it imports: line of the first import}


def _module_of(path: str) -> tuple[str, bool]:
    """`a/b/c.py` → (`a.b.c`, False); `a/b/__init__.py` → (`a.b`, True)."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imported(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: Collection[str]
) -> list[str]:
    """What one import statement of `module` reaches: `import a.b` → a.b; `from a.b import c`
    → a.b.c when that is one of `modules`, else a.b (c is a name a.b defines)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = base_of(node, module if is_package else module.rpartition(".")[0] or None)
    if base is None:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(files: dict[str, str]) -> ImportGraph:
    """The import graph of `files` (path relative to the repository root → source)."""
    modules = dict(_module_of(path) for path in files)
    graph: ImportGraph = {module: {} for module in modules}
    for path, source in files.items():
        module, is_package = _module_of(path)
        for node in ast.walk(ast.parse(source, filename=path)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(module, is_package, node, modules):
                    if target in modules and target != module:
                        graph[module].setdefault(target, node.lineno)
    return graph


def import_cycles(graph: ImportGraph) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan's
    algorithm, iterative so a deep chain cannot hit the recursion limit), each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def shortest_loop(graph: ImportGraph, component: list[str]) -> list[str]:
    """One shortest way round `component` from its first module back to it (breadth first,
    inside the component), e.g. [a, b, a]."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor == start:
                    loop = [start, node]
                    while loop[-1] != start:
                        loop.append(came_from[loop[-1]])
                    return loop[::-1]
                if successor in members and successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{component} is not a cycle")


def describe_cycles(graph: ImportGraph) -> str:
    """Each cycle as its modules and one way round with the importing lines, for a reader
    who has to break it."""
    lines = []
    for component in import_cycles(graph):
        loop = shortest_loop(graph, component)
        steps = "".join(f"{a} —line {graph[a][b]}→ " for a, b in itertools.pairwise(loop))
        lines += [
            f"{len(component)} modules import each other: {', '.join(component)}",
            f"    e.g. {steps}{loop[-1]}",
        ]
    return "\n".join(lines)


def product_sources() -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for package in PRODUCT_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_no_import_cycle_in_the_product():
    graph = import_graph(product_sources())
    assert import_cycles(graph) == [], "import cycles:\n" + describe_cycles(graph)


MAX_MODULE_LINES = 600
"""A module past this is two subjects (issue #29 split the three that had grown past it)."""
MAX_AUTHORITY_LINES = 3000
"""`ca_server/authority/` is the slot rows and the drivers; the fleet lives in its own wing."""


def test_no_product_module_is_over_its_size():
    sizes = {path: source.count("\n") for path, source in product_sources().items()}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}
    authority = sum(n for path, n in sizes.items() if path.startswith("ca_server/authority/"))
    assert 0 < authority <= MAX_AUTHORITY_LINES


def test_the_cycle_check_finds_a_planted_two_module_cycle():
    graph = import_graph(
        {
            "p/__init__.py": "",
            "p/a.py": "def late():\n    from p.b import thing\n",
            "p/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\n",
            "p/c.py": "import p.a\nimport os\n",
        }
    )
    assert import_cycles(graph) == [["p.a", "p.b"]]
    assert shortest_loop(graph, ["p.a", "p.b"]) == ["p.a", "p.b", "p.a"]
    assert describe_cycles(graph) == (
        "2 modules import each other: p.a, p.b\n    e.g. p.a —line 2→ p.b —line 3→ p.a"
    )


def test_the_cycle_check_finds_a_planted_three_module_cycle_through_relative_imports():
    graph = import_graph(
        {
            "p/__init__.py": "from p.q import x\n",
            "p/q/__init__.py": "from .deep import x\n",
            "p/q/deep.py": "from .. import r, VERSION\n",  # the module p.r, a name of p
            "p/r.py": "import os\n",
            "p/s.py": "from . import r\n",
        }
    )
    assert import_cycles(graph) == [["p", "p.q", "p.q.deep"]]


def test_the_cycle_check_reports_a_module_that_imports_its_own_facade():
    """The facade imports the module, the module imports a name from the facade: a circle
    Python only survives when the name happens to be bound before the module asks for it."""
    graph = import_graph(
        {
            "p/__init__.py": "from p.impl import run\nLIMIT = 3\n",
            "p/impl.py": "from p import LIMIT\n",
            "p/other.py": "from p.impl import run\n",  # parents run first, yet no edge to p
        }
    )
    assert import_cycles(graph) == [["p", "p.impl"]]


def test_the_cycle_check_passes_an_acyclic_graph():
    """A diamond, a package whose modules import siblings (not the facade), and names that are
    no modules: no edge back, no cycle."""
    graph = import_graph(
        {
            "p/__init__.py": "from p.a import x\nfrom p.b import y\n",
            "p/a.py": "from p.c import z\n",
            "p/b.py": "import json\nfrom . import c\n",
            "p/c.py": "def late():\n    import p.d.nothing_here\n",
            "p/d.py": "import os.path\n",
        }
    )
    assert import_cycles(graph) == []
    assert graph["p"] == {"p.a": 1, "p.b": 2}
    assert graph["p.b"] == {"p.c": 2}  # `from . import c` is `import p.c`: p runs, no edge
    assert graph["p.c"] == {}  # p.d.nothing_here is no module: no edge


# -- prose that names the code ---------------------------------------------------------------
#
# Docstrings and comments point a reader at other modules (`ca_server.kube.secret_root`,
# `agent/sds.py`, `meshca.wire.MAX_REPORT_INTERVAL`). A move that forgets them leaves a reader
# looking for a file that is not there, so every such backquoted name must exist: a path from the
# repository root (or under `proto/`), a module, or a top-level name of one. The `meshca.*`
# names that are no Python (a logger, the protos' package) are listed as such.

NOT_MODULES = ("meshca.audit", "meshca.v1")  # the audit logger; the protos' package
NAMED_PACKAGES = (*PRODUCT_PACKAGES, "meshca_proto")
REPOSITORY_DIRECTORIES = (*NAMED_PACKAGES, "tests", "docs", "deploy", "proto", "bench")
_BACKQUOTED = re.compile(r"`([^`\s]+)`")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"[\w.-]+(/[\w.-]+)+/?")


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment of `source`."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                yield value.lineno, value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def _source_of(module: str, root: Path) -> Path | None:
    for base in (root, root / "proto"):
        path = base.joinpath(*module.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def top_level_names(source: str) -> set[str]:
    """What `import module` gives a reader: its definitions, assignments and imports, also
    those under a top-level `if` (TYPE_CHECKING)."""
    names: set[str] = set()
    tree = ast.parse(source)
    for node in [*tree.body, *(n for s in tree.body if isinstance(s, ast.If) for n in s.body)]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


@functools.cache
def _names_in(source: Path) -> frozenset[str]:
    return frozenset(top_level_names(source.read_text(encoding="utf-8")))


def missing_reference(name: str, root: Path) -> str | None:
    """Why backquoted `name` names nothing in the repository at `root`, or None when it does
    (or is no reference to it)."""
    name = name.rstrip(".,:;")
    if _PATH.fullmatch(name) and name.split("/")[0] in REPOSITORY_DIRECTORIES:
        if (root / name).exists() or (root / "proto" / name).exists():
            return None
        return f"no path {name}"
    if not _DOTTED.fullmatch(name) or name.split(".")[0] not in NAMED_PACKAGES:
        return None
    if within(name, NOT_MODULES):
        return None
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        source = _source_of(".".join(parts[:length]), root)
        if source is not None:
            break
    assert source is not None  # the first part is one of NAMED_PACKAGES
    if length == len(parts) or parts[length] in _names_in(source):
        return None
    module = ".".join(parts[:length])
    return f"no module {module}.{parts[length]}, nor a name {parts[length]} in {module}"


def stale_references(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for line, text in prose(path.read_text(encoding="utf-8")):
        for match in _BACKQUOTED.finditer(text):
            why = missing_reference(match.group(1), root)
            if why is not None:
                found.append(f"{path.relative_to(root)}:{line}: `{match.group(1)}`: {why}")
    return found


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_the_prose_names_only_modules_and_paths_that_exist(package: str):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        found += stale_references(path)
    assert found == [], "\n".join(found)


def test_the_prose_check_sees_a_name_that_moved(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "real.py").write_text("LIMIT = 3\n\nclass Thing:\n    pass\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("")
    for name in ("pkg.real", "pkg.real.LIMIT", "pkg.real.Thing.method", "docs/x.md", "os.path"):
        assert missing_reference(name, tmp_path) is None, name
    assert missing_reference("ca_server.kube.gone.", ROOT) == (
        "no module ca_server.kube.gone, nor a name gone in ca_server.kube"
    )
    assert missing_reference("agent.sds.NO_SUCH_LIMIT", ROOT) == (
        "no module agent.sds.NO_SUCH_LIMIT, nor a name NO_SUCH_LIMIT in agent.sds"
    )
    assert missing_reference("tests/test_gone.py", ROOT) == "no path tests/test_gone.py"
    assert missing_reference("meshca.audit", ROOT) is None  # a logger, not a module
    lines = list(prose('"""See `a.b`."""\nX = "`c.d`"  # and `e.f`\n'))
    assert lines == [(1, "See `a.b`."), (2, "# and `e.f`")]


# Packages whose `__init__.py` docstring is their module map: it names every module in the
# folder, so a newcomer finds each file's job in one place.
MAPPED_PACKAGES = (
    "ca_server/authority",
    "ca_server/fleet",
    "ca_server/kube",
    "ca_server/serving",
    "agent",
    "agent/workload",
)


def unmapped_modules(package: Path, root: Path = ROOT) -> list[str]:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text("utf-8"))) or ""
    named = set(_BACKQUOTED.findall(docstring))
    dotted = ".".join(package.relative_to(root).parts)
    modules = sorted(
        [path.stem for path in package.glob("*.py") if path.name != "__init__.py"]
        + [path.parent.name for path in package.glob("*/__init__.py")]
    )
    return [m for m in modules if not named & {m, f"{m}.py", f"{dotted}.{m}"}]


@pytest.mark.parametrize("package", MAPPED_PACKAGES)
def test_a_module_map_names_every_module_of_its_package(package: str):
    assert unmapped_modules(ROOT / package) == []


def test_the_module_map_check_sees_a_module_left_out(tmp_path: Path):
    package = tmp_path / "pkg" / "sub"
    (package / "inner").mkdir(parents=True)
    for name in ("__init__.py", "named.py", "dotted.py", "file.py", "left_out.py"):
        (package / name).write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        '"""- `named`: one.\n- `pkg.sub.dotted`: two.\n- `file.py`: three.\n"""\n'
    )
    assert unmapped_modules(package, tmp_path) == ["inner", "left_out"]
