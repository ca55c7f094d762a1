"""`meshca.waiting.result_within`: a time limit that neither cancels the work nor hides a stop."""

from __future__ import annotations

import asyncio
import gc

import pytest

from meshca.waiting import cancel_and_wait, result_within


def test_a_cancellation_arriving_with_the_result_still_cancels_the_waiter() -> None:
    """The Python 3.11 `wait_for` race: the future finishes and the waiter is cancelled in the
    same loop iteration. `wait_for(shield(f))` returns the result then (the stop is lost);
    `result_within` must end cancelled."""

    async def main() -> None:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(result_within(future, 10))
        await asyncio.sleep(0)  # the waiter is now inside asyncio.wait
        future.set_result(1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert future.result() == 1

    asyncio.run(main())


def test_a_timeout_leaves_the_work_running_and_its_late_failure_retrieved() -> None:
    reported: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
        future: asyncio.Future[int] = loop.create_future()
        with pytest.raises(TimeoutError):
            await result_within(future, 0.01)
        assert not future.done()  # not cancelled: a thread's work cannot be
        future.set_exception(OSError("late"))
        await asyncio.sleep(0)  # the done callback runs
        del future
        gc.collect()  # an unretrieved exception is reported when the future is collected

    asyncio.run(main())
    assert reported == []


def test_the_result_or_the_works_own_error_is_returned() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert await result_within(asyncio.ensure_future(asyncio.to_thread(lambda: 7)), 5) == 7
        failing = loop.run_in_executor(None, int, "x")
        with pytest.raises(ValueError):
            await result_within(failing, 5)

    asyncio.run(main())


def test_cancel_and_wait_returns_once_the_task_has_unwound() -> None:
    unwound: list[str] = []

    async def background() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits
            unwound.append("finally ran")

    async def main() -> None:
        await cancel_and_wait(None)  # never started: nothing to do
        task = asyncio.create_task(background())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        assert unwound == ["finally ran"]
        assert task.cancelled()

    asyncio.run(main())
