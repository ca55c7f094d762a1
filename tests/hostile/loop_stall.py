"""Measuring whether something blocks the asyncio event loop: a heartbeat task ticks every 20 ms
while the awaited work runs; the longest gap between ticks is how long the loop was stuck."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def longest_stall(work: Awaitable[T]) -> tuple[T | BaseException, float]:
    """(result or the exception `work` raised, longest loop stall in seconds)."""
    beats: list[float] = []

    async def heartbeat() -> None:
        while True:
            beats.append(time.monotonic())
            await asyncio.sleep(0.02)

    ticker = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.05)
    outcome: T | BaseException
    try:
        outcome = await work
    except Exception as exc:
        outcome = exc
    await asyncio.sleep(0.05)
    ticker.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    return outcome, max(gaps)
