"""Which modules a source file imports, read with `ast` (nothing is imported or run).

A lazy import inside a function or under `if TYPE_CHECKING:` counts as much as one at the top,
so rules about imports (the agent's module boundaries, the test suite's layout) hold for every
path the code can take.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator


def imported_modules(source: str, package: str | None = None) -> Iterator[str]:
    """Every module `source` imports, at any depth: `import a.b` gives a.b; `from a.b import c`
    gives a.b and a.b.c (c may be a module or a name a.b defines). A relative import is
    resolved against `package` (the package the source's module belongs to), or skipped when
    no package is given."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = base_of(node, package)
            if base is not None:
                yield base
                yield from (f"{base}.{alias.name}" for alias in node.names)


def base_of(node: ast.ImportFrom, package: str | None) -> str | None:
    """The module a `from ... import` names, its leading dots resolved against `package`."""
    if node.level == 0:
        return node.module
    if package is None:
        return None
    parts = package.split(".")
    if node.level > len(parts):
        return None  # above the top-level package: Python refuses it too
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def within(module: str, packages: tuple[str, ...]) -> bool:
    """Whether `module` is one of `packages` or inside one of them."""
    return any(module == p or module.startswith(p + ".") for p in packages)
