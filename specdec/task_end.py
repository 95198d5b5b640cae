"""Ending a background task for sure.

`task.cancel()` followed by `await task` is not always enough on Python 3.11: its
asyncio.wait_for returns the result and drops a cancellation that lands in the same turn
as what it waits on, and the task then goes on. wait_for sits in redis-py's socket writes
(every command under a socket timeout) and sat in the micro-batcher's hold; a replica's
stop that cancelled its batcher or its heartbeat once and then awaited it could wait for
ever, still registered in the second case.
"""
from __future__ import annotations

import asyncio

RETRY_S = 0.1


async def end_task(task: asyncio.Task | None, retry_s: float = RETRY_S) -> None:
    """Cancel `task` until it has ended. The caller's own cancellation is not swallowed
    (asyncio.wait, not `await task`, whose CancelledError cannot be told from the caller's)."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=retry_s)


async def end_other_tasks(timeout: float, retry_s: float = RETRY_S) -> list[asyncio.Task]:
    """Cancel every other task of the running loop until each has ended or `timeout` has
    passed → those still running. A server's stop calls it last: asyncio.run then cancels
    what is left once and waits for it without limit, so one task that dropped that
    cancellation (above) and looped on would keep the process from ever exiting."""
    loop = asyncio.get_running_loop()
    me, deadline = asyncio.current_task(), loop.time() + timeout
    while True:
        left = [task for task in asyncio.all_tasks() if task is not me and not task.done()]
        remaining = deadline - loop.time()
        if not left or remaining <= 0:
            return left
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=min(retry_s, remaining))
