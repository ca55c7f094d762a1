"""The `process` marker, per test: marked by what the test starts, enforced while it runs.

A test is `process` when it starts something outside its own thread of control: a child
process (the CA, an agent, Envoy, the `meshca` command, a compiler) or the fake Kubernetes API
server. `pytest -m "not process"` is then the inner loop: every test that starts none of them.

How a test gets the marker:

- **Through its fixtures.** A fixture that starts a process or server requests the
  `starts_processes` fixture; every test whose fixture closure holds it (directly or through
  other fixtures, whatever their names) is marked at collection.
- **Through its own body.** A test that starts one itself (`subprocess.run`,
  `CaProcess(...).start()`, `KubeApiServer().start()`) carries `@pytest.mark.process`; a module
  whose every test does so says it once (`pytestmark = pytest.mark.process  # what they start`).
  The `envoy` marker implies `process`.

How no test can forget it: while an unmarked test sets up or runs, starting a child process
(`subprocess`, `os.fork`, `os.posix_spawn`, `multiprocessing`) or calling `refuse_unless_marked`
(the fake API server does, when it starts) fails the test, naming what it started; in a thread
of the test too, since the refusal is also recorded and reported when the test ends. Teardown is
not checked: a module's fixtures stop (never start) their processes there, in whichever test
of the module happens to be the last.

Loaded by tests/conftest.py (`pytest_plugins`); outside pytest nothing is refused.
"""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

FIXTURE = "starts_processes"

# The test being run without the marker (its node id), or None: anything may start.
_unmarked_test: str | None = None
# What the unmarked test started (or tried to), reported when it ends.
_refused: list[str] = []


class ProcessStartedInUnmarkedTest(pytest.fail.Exception):  # type: ignore[name-defined]
    """A BaseException, like pytest.fail's: the product's `except Exception` cannot hide it."""


def refuse_unless_marked(what: str) -> None:
    """Fails the running test if it is not marked `process`: `what` is being started."""
    test = _unmarked_test
    if test is None:
        return
    _refused.append(what)
    raise ProcessStartedInUnmarkedTest(
        f"{test} started {what} but is not marked `process`: request a fixture that starts it "
        f"through `{FIXTURE}`, or mark the test `@pytest.mark.process` "
        f"(tests/support/process_marker.py)",
        pytrace=False,
    )


def _guarded(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        refuse_unless_marked(what)
        return original(*args, **kwargs)

    return guarded


def _guarded_popen(original: Callable[..., Any]) -> Callable[..., Any]:
    def execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> Any:
        command = args if isinstance(args, (str, bytes)) else " ".join(map(str, args))
        refuse_unless_marked(f"a child process ({str(command)[:120]})")
        return original(self, args, *rest, **kwargs)

    return execute_child


_installed = False


def _install() -> None:
    """Wraps every way this interpreter starts a child process (once per interpreter)."""
    global _installed
    if _installed:
        return
    _installed = True
    popen: Any = subprocess.Popen
    popen._execute_child = _guarded_popen(popen._execute_child)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            setattr(os, name, _guarded(getattr(os, name), f"a child process (os.{name})"))
    spawnv_passfds = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = _guarded(
        spawnv_passfds, "a child process (multiprocessing)"
    )


def is_process_test(item: pytest.Item) -> bool:
    return item.get_closest_marker("process") is not None


@pytest.fixture(scope="session")
def starts_processes() -> None:
    """Requested by every fixture that starts a process or a server: marks the tests using it."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "process: the test starts a process or server (tests/support/process_marker.py)"
    )
    _install()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if FIXTURE in getattr(item, "fixturenames", ()) or item.get_closest_marker("envoy"):
            item.add_marker(pytest.mark.process)


def _checked(item: pytest.Item) -> Iterator[None]:
    global _unmarked_test
    outer_test, outer_refused = _unmarked_test, _refused[:]
    _unmarked_test = None if is_process_test(item) else item.nodeid
    _refused.clear()
    try:
        yield
    finally:
        refused = _refused[:]
        _unmarked_test = outer_test
        _refused[:] = outer_refused
    if refused:
        # Started from a thread of the test, or caught on the way out: the test fails anyway.
        raise ProcessStartedInUnmarkedTest(
            f"{item.nodeid} started {refused[0]} but is not marked `process`", pytrace=False
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _checked(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _checked(item))
