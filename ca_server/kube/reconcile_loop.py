"""The loop every leader-driven writer of the CA runs in its thread (`root_publisher`,
`trust_bundles`, `istiod_tls`): sleep until woken or until the next pass is due, reconcile, and
after a failed pass wait a moment and try again, until stopped; the thread that runs it with
a wake-up and a guard against the unexpected (`ReconcileThread`); and the guard around each
write of a pass (`guarded_write`). One place, so the writers retry and count alike."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from meshca.kube_client import api_error_text

RETRY_AFTER_ERROR = 1.0  # seconds between a failed pass and the next try


def run_reconcile_loop(
    stopping: threading.Event,
    wake: threading.Event,
    wait_seconds: Callable[[], float],
    reconcile: Callable[[], bool],
) -> None:
    """Runs `reconcile()` (True: the pass worked) whenever `wake` is set or `wait_seconds()`
    passed, until `stopping` is set."""
    while not stopping.is_set():
        wake.wait(wait_seconds())
        wake.clear()
        if stopping.is_set():
            return
        if not reconcile():
            stopping.wait(RETRY_AFTER_ERROR)
            wake.set()


def guarded_write(
    what: str, call: Callable[[], object], outcome: Callable[[str], None], log: logging.Logger
) -> bool:
    """Runs one write of a reconcile pass (`what`: "create ns/name", for the log) and counts
    its result through `outcome` ("ok", "conflict", "error"). A 404 or 409 means someone changed
    the object since the watch saw it: not a failure, the watch shows the new state and wakes
    another pass. True unless the pass should be retried soon."""
    try:
        call()
    except ApiException as exc:
        if exc.status in (404, 409):
            outcome("conflict")
            log.info("%s raced another change (HTTP %s); will re-check", what, exc.status)
            return True
        outcome("error")
        log.warning("could not %s: %s", what, api_error_text(exc))
        return False
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        outcome("error")
        log.warning("could not %s: %s", what, exc)
        return False
    outcome("ok")
    log.info("%s: done", what)
    return True


class ReconcileThread:
    """The thread a leader-driven writer reconciles in: woken by `kick()` (from watch threads,
    the election thread or the event loop), or every `wait_seconds()`. Anything unexpected a
    pass raises is logged and the pass retried: the thread must outlive it, or a leader would
    hold the Lease while writing nothing."""

    def __init__(
        self,
        name: str,
        wait_seconds: Callable[[], float],
        reconcile: Callable[[], bool],
        log: logging.Logger,
    ) -> None:
        self._wait_seconds = wait_seconds
        self._reconcile = reconcile
        self._log = log
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def kick(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def _run(self) -> None:
        run_reconcile_loop(self._stopping, self._wake, self._wait_seconds, self._guarded)

    def _guarded(self) -> bool:
        try:
            return self._reconcile()
        except Exception:
            self._log.exception("%s: a pass failed unexpectedly; retrying", self._thread.name)
            return False
