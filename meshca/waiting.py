"""Waiting on background work: with a time limit (`result_within`), and at a stop
(`cancel_and_wait`).

The time limit avoids `asyncio.wait_for`'s two traps.

`wait_for` cancels what it waits for on timeout (a read in a worker thread cannot be cancelled,
and a shared future must outlive one impatient caller), and on Python 3.11 it can swallow a
cancellation of the waiting task that arrives just as the future finishes: the task then runs
on and a stop that cancels it hangs. `asyncio.wait` has neither problem, so every time-limited
wait on work that runs elsewhere (worker threads, shared reads) goes through `result_within`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, TypeVar

T = TypeVar("T")


async def result_within(future: asyncio.Future[T], timeout: float) -> T:
    """`future`'s result (or its exception), or `TimeoutError` after `timeout` seconds with
    `future` left running. Cancelling the caller never cancels `future`; a future the caller
    stops waiting for has its late outcome marked as retrieved (no "exception was never
    retrieved" at exit)."""
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout)
    finally:
        if not future.done():
            future.add_done_callback(_retrieve)
    if not done:
        raise TimeoutError
    return future.result()


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancels a background task and waits until it has finished unwinding, so a stop returns
    only once the task's `finally` blocks have run; `None` (never started) is fine."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
