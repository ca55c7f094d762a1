"""`--cpu-scheduling`: the CA's threads under SCHED_BATCH (or back to the default policy),
set in real threads of this process; the whole CA is checked in `test_workers.py`."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ca_server.serving.cpu_scheduling import apply_cpu_scheduling


def _in_a_thread(body: Callable[[], Any]) -> Any:
    """Runs `body` in a fresh thread (the policy is per thread: the test runner's own is never
    touched) and returns what it returned."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(body()))
    thread.start()
    thread.join()
    return result[0]


def test_batch_is_set_and_inherited_by_threads_started_afterwards() -> None:
    def body() -> tuple[bool, int, int]:
        applied = apply_cpu_scheduling("batch")
        child = _in_a_thread(lambda: os.sched_getscheduler(0))
        return applied, os.sched_getscheduler(0), child

    applied, own, child = _in_a_thread(body)
    assert applied
    assert own == os.SCHED_BATCH
    assert child == os.SCHED_BATCH  # what gRPC's threads get once the CA starts them


def test_normal_puts_a_batch_thread_back_under_the_default_policy() -> None:
    def body() -> tuple[bool, int]:
        assert apply_cpu_scheduling("batch")
        applied = apply_cpu_scheduling("normal")
        return applied, os.sched_getscheduler(0)

    assert _in_a_thread(body) == (True, os.SCHED_OTHER)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'idle'"):
        apply_cpu_scheduling("idle")


def test_a_refusal_is_logged_and_the_ca_keeps_the_policy_it_had(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A seccomp profile that forbids sched_setscheduler (injected: it cannot be installed
    in a test run) must not stop the CA."""

    def refuse(pid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with caplog.at_level(logging.WARNING, logger="ca_server.serving.cpu_scheduling"):
        assert _in_a_thread(lambda: apply_cpu_scheduling("batch")) is False
    assert "--cpu-scheduling batch refused (Operation not permitted)" in caplog.text
