"""`certs` is the library both sides build on: what its package exports is exactly its
`__all__`, each name there is importable, and nothing private leaks (after httpx's
tests/test_exported_members.py)."""

from __future__ import annotations

import inspect

import certs


def _public_members() -> set[str]:
    """The package's names a user sees: all but private ones and the submodules themselves."""
    return {
        name
        for name, value in vars(certs).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }


def test_the_package_exports_exactly_its_all() -> None:
    assert len(certs.__all__) == len(set(certs.__all__)), "a name is listed twice"
    assert set(certs.__all__) == _public_members()


def test_each_exported_name_is_importable() -> None:
    """`from certs import *` takes `__all__`, and fails on a name the package lacks."""
    namespace: dict[str, object] = {}
    exec("from certs import *", namespace)
    del namespace["__builtins__"]
    assert namespace == {name: getattr(certs, name) for name in certs.__all__}


def test_nothing_private_leaks() -> None:
    assert not [name for name in certs.__all__ if name.startswith("_")]
    homes = {
        name: value.__module__
        for name in certs.__all__
        if inspect.isclass(value := getattr(certs, name)) or inspect.isfunction(value)
    }
    outside = {name: home for name, home in homes.items() if not home.startswith("certs.")}
    assert not outside, f"exported from outside certs: {outside}"
    private = {name: home for name, home in homes.items() if "._" in home}
    assert not private, f"exported from a private module: {private}"
