from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from meshca.clock import Clock, FakeClock, SystemClock

START = datetime(2031, 1, 1, tzinfo=UTC)


def test_fake_clock_starts_where_told_and_advances() -> None:
    clock = FakeClock(START)
    assert clock.now() == START
    clock.advance(90)
    assert clock.now() == START + timedelta(seconds=90)
    clock.advance(timedelta(hours=1))
    assert clock.now() == START + timedelta(hours=1, seconds=90)


def test_fake_clock_default_start_is_aware_utc() -> None:
    now = FakeClock().now()
    assert now.tzinfo is not None
    assert now.utcoffset() == timedelta(0)


def test_system_clock_is_aware_utc() -> None:
    clock = SystemClock()
    now = clock.now()
    assert now.utcoffset() == timedelta(0)
    assert abs(now - datetime.now(UTC)) < timedelta(seconds=5)
    assert clock.monotonic() <= clock.monotonic()


def test_both_satisfy_the_protocol() -> None:
    clocks: list[Clock] = [SystemClock(), FakeClock()]
    assert all(isinstance(c.now(), datetime) for c in clocks)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_sleepers_wake_when_advance_passes_their_deadline() -> None:
    async def scenario() -> None:
        clock = FakeClock(START)
        woke: list[str] = []

        async def sleeper(name: str, seconds: float) -> None:
            await clock.sleep(seconds)
            woke.append(name)

        tasks = [
            asyncio.create_task(sleeper("short", 10)),
            asyncio.create_task(sleeper("long", 30)),
        ]
        await _settle()
        assert woke == []

        clock.advance(9)
        await _settle()
        assert woke == []

        clock.advance(1)  # exactly at the deadline
        await _settle()
        assert woke == ["short"]

        clock.advance(timedelta(seconds=15))
        await _settle()
        assert woke == ["short"]

        clock.advance(100)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=1)
        assert woke == ["short", "long"]
        assert clock._sleepers == []

    asyncio.run(scenario())


def test_deadline_counts_from_when_sleep_started() -> None:
    async def scenario() -> None:
        clock = FakeClock(START)
        clock.advance(50)
        task = asyncio.create_task(clock.sleep(10))
        await _settle()
        clock.advance(9)
        await _settle()
        assert not task.done()
        clock.advance(1)
        await asyncio.wait_for(task, timeout=1)

    asyncio.run(scenario())


@pytest.mark.parametrize("seconds", [0, -5])
def test_non_positive_sleep_returns_without_advancing(seconds: float) -> None:
    async def scenario() -> None:
        clock = FakeClock(START)
        await asyncio.wait_for(clock.sleep(seconds), timeout=1)
        assert clock.now() == START

    asyncio.run(scenario())


def test_cancelled_sleeper_is_forgotten() -> None:
    async def scenario() -> None:
        clock = FakeClock(START)
        task = asyncio.create_task(clock.sleep(60))
        await _settle()
        assert len(clock._sleepers) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert clock._sleepers == []
        clock.advance(120)  # must not touch the cancelled future

    asyncio.run(scenario())


def test_system_clock_sleep_clamps_negative() -> None:
    async def scenario() -> None:
        await asyncio.wait_for(SystemClock().sleep(-1), timeout=1)

    asyncio.run(scenario())
