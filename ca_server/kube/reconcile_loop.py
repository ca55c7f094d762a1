"""The loop every leader-driven writer of the CA runs in its thread (`root_publisher`,
`istiod_tls`): sleep until woken or until the next pass is due, reconcile, and after a failed
pass wait a moment and try again, until stopped. One place, so both writers retry alike."""

from __future__ import annotations

import threading
from collections.abc import Callable

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
