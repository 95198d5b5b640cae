"""end_task, end_other_tasks: a background task is ended for sure, even where Python 3.11's asyncio.wait_for
drops the cancellation, and the caller's own cancellation still reaches the caller."""
from __future__ import annotations

import asyncio

import pytest

from specdec.task_end import end_other_tasks, end_task


async def waits_with_wait_for(event: asyncio.Event, woken: list[int]) -> None:
    """A loop like the batcher's hold: on Python 3.11 a cancellation that lands as the event
    is set is dropped by wait_for, and the loop goes on."""
    while True:
        try:
            await asyncio.wait_for(event.wait(), 60)
            event.clear()
            woken.append(1)
        except asyncio.TimeoutError:
            pass


def test_a_task_is_ended_even_where_a_cancellation_is_dropped():
    async def go():
        event, woken = asyncio.Event(), []
        task = asyncio.create_task(waits_with_wait_for(event, woken))
        await asyncio.sleep(0.05)
        event.set()  # the event and the cancellation in the same turn
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with asyncio.timeout(5):
            await end_task(task)
        return task.done(), loop.time() - t0

    done, seconds = asyncio.run(go())
    assert done and seconds < 1


def test_ending_nothing_or_an_ended_task_returns_at_once():
    async def go():
        await end_task(None)
        task = asyncio.create_task(asyncio.sleep(0))
        await task
        await end_task(task)
        return task.done()

    assert asyncio.run(go())


async def refuses_to_end(release: asyncio.Event) -> None:
    """Swallows every cancellation until `release` is set."""
    while not release.is_set():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            continue


def test_the_callers_own_cancellation_is_not_swallowed():
    """`task.cancel(); await task` inside `except CancelledError: pass` also swallowed a
    cancellation of the one stopping: a stop cut short by a timeout went on."""
    release = asyncio.Event()

    async def go():
        task = asyncio.create_task(refuses_to_end(release))
        await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await end_task(task)
        release.set()
        await end_task(task)
        return task.done()

    assert asyncio.run(go())


def test_a_stop_ends_the_other_tasks_and_names_those_that_will_not_end():
    """Three tasks left at a stop: one that drops a cancellation (the wait_for loop above),
    one that ends at its first, and one that never ends. The first two are ended; the last
    is returned once the time is up, the caller not stuck on it (asyncio.run would be)."""
    release = asyncio.Event()

    async def go():
        event = asyncio.Event()
        dropping = asyncio.create_task(waits_with_wait_for(event, []))
        plain = asyncio.create_task(asyncio.sleep(60))
        stubborn = asyncio.create_task(refuses_to_end(release))
        await asyncio.sleep(0.05)
        event.set()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        left = await end_other_tasks(0.5)
        seconds = loop.time() - t0
        ended = dropping.done(), plain.done()
        release.set()
        await end_task(stubborn)
        return left == [stubborn], ended, seconds, await end_other_tasks(0.5)

    only_stubborn, ended, seconds, none_left = asyncio.run(go())
    assert only_stubborn and ended == (True, True) and 0.5 <= seconds < 1.5 and none_left == []
