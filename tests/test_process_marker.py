"""The `process` marker (tests/support/process_marker.py): a test is marked by what it starts,
through its fixtures whatever their names, and an unmarked test that starts a process or the
fake API server fails instead of slipping into the inner loop. Runs pytest on small test files
(pytester, in this process); nothing here starts a process: every start tried below is refused."""

from __future__ import annotations

import pytest

# Imported here, not first by the test files below: pytester forgets the modules a run imports.
import tests.support.ca_process
import tests.support.kube_api
import tests.support.status_cli  # noqa: F401

pytest_plugins = ["pytester"]

# The plugin under test; hypothesis's plugin off, as importing hypothesis afresh costs a second.
PLUGIN = (
    "-p",
    "tests.support.process_marker",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:hypothesispytest",
)

FIXTURES = """
import pytest

@pytest.fixture
def server(starts_processes):
    return "a server"

@pytest.fixture
def client(server):
    return "a client of " + server

@pytest.fixture
def ca():
    return "a test CA in memory"
"""


def _selected(pytester: pytest.Pytester, marker_expression: str) -> set[str]:
    """The names of the tests `-m marker_expression` selects."""
    recorder = pytester.inline_run(*PLUGIN, "--collect-only", "-m", marker_expression)
    (finished,) = recorder.getcalls("pytest_collection_finish")
    return {item.name for item in finished.session.items}


def test_a_test_is_marked_through_its_fixtures_and_its_own_marker(pytester: pytest.Pytester):
    pytester.makeconftest(FIXTURES)
    pytester.makepyfile(
        test_mixed="""
        import pytest

        def test_uses_the_server(server): pass
        def test_uses_it_through_another_fixture(client): pass
        def test_uses_a_pure_fixture(ca): pass
        def test_pure(): pass

        @pytest.mark.process
        def test_starts_one_itself(): pass

        @pytest.mark.envoy
        def test_runs_envoy(): pass
        """,
        test_same_name="""
        import pytest

        @pytest.fixture
        def ca(starts_processes):
            return "a CA process"

        def test_a_ca_of_the_same_name_that_is_a_process(ca): pass
        """,
    )
    assert _selected(pytester, "process") == {
        "test_uses_the_server",
        "test_uses_it_through_another_fixture",
        "test_starts_one_itself",
        "test_runs_envoy",
        "test_a_ca_of_the_same_name_that_is_a_process",
    }
    assert _selected(pytester, "not process") == {"test_uses_a_pure_fixture", "test_pure"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_unmarked_test_that_starts_a_process_fails_naming_it(pytester: pytest.Pytester):
    pytester.makepyfile(
        test_forgot="""
        import multiprocessing, os, subprocess, threading
        import pytest

        def test_runs_a_command():
            subprocess.run(["true"], check=True)

        def test_swallows_the_refusal():
            try:
                subprocess.run(["true"], check=True)
            except Exception:
                pass

        def test_starts_it_from_a_thread():
            thread = threading.Thread(target=lambda: subprocess.run(["true"]))
            thread.start()
            thread.join()

        def test_forks():
            os.fork()

        def test_uses_multiprocessing():
            multiprocessing.get_context("spawn").Process(target=print).start()

        @pytest.fixture
        def started():
            subprocess.Popen(["sleep", "1"])

        def test_through_a_fixture_that_does_not_say(started): pass

        def test_starts_nothing(): pass
        """
    )
    result = pytester.runpytest_inprocess(*PLUGIN)
    result.assert_outcomes(passed=1, failed=5, errors=1)
    for line in (
        "*::test_runs_a_command started a child process (true) but is not marked `process`*",
        "*::test_swallows_the_refusal started a child process (true)*",
        "*::test_starts_it_from_a_thread started a child process (true)*",
        "*::test_forks started a child process (os.fork)*",
        "*::test_uses_multiprocessing started a child process (multiprocessing)*",
        "*::test_through_a_fixture_that_does_not_say started a child process (sleep 1)*",
    ):
        result.stdout.fnmatch_lines([line])


def test_the_fake_api_server_is_refused_to_an_unmarked_test_and_allowed_to_a_marked_one(
    pytester: pytest.Pytester,
):
    pytester.makepyfile(
        test_kube="""
        import pytest
        from tests.support.process_marker import refuse_unless_marked
        from tests.support.kube_api import KubeApiServer

        def test_unmarked():
            KubeApiServer()  # building one starts nothing
            refuse_unless_marked("the fake Kubernetes API server")

        @pytest.mark.process
        def test_marked():
            refuse_unless_marked("the fake Kubernetes API server")
        """
    )
    result = pytester.runpytest_inprocess(*PLUGIN)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked started the fake Kubernetes API server*"])


def test_every_process_helper_of_the_suite_is_refused_when_unmarked(pytester: pytest.Pytester):
    """The helpers start their children through subprocess, and the fake API server checks."""
    pytester.makepyfile(
        test_helpers="""
        import pytest
        from tests.support.ca_process import CaProcess
        from tests.support.kube_api import KubeApiServer
        from tests.support.status_cli import meshca_status

        def test_ca(tmp_path):
            CaProcess(tmp_path / "data").start()

        def test_status():
            meshca_status("--help")

        def test_kube_api():
            KubeApiServer().start()
        """
    )
    result = pytester.runpytest_inprocess(*PLUGIN)
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(
        [
            "*test_ca started a child process (* -m meshca ca *",
            "*test_status started a child process (* -m meshca status --help)*",
            "*test_kube_api started the fake Kubernetes API server*",
        ],
        consecutive=False,
    )
