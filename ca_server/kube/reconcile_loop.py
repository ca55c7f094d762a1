"""The loop every leader-driven writer of the CA runs in its thread (`root_publisher`,
`trust_bundles`, `istiod_tls`): sleep until woken or until the next pass is due, reconcile, and
after a failed pass wait a moment and try again, until stopped; and the guard around each write
of a pass (`guarded_write`). One place, so the writers retry and count alike."""

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
