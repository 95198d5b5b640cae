"""A window of retries with backoff, for Redis commands that may safely run twice (the
round commits, the session unlock): they wait out a Redis restart for a while, then give up."""
from __future__ import annotations

import asyncio
import time


class RetryWindow:
    """Waits of 50 ms, doubling up to 0.5 s, until the next wait would end past `seconds`
    from now."""

    def __init__(self, seconds: float) -> None:
        self.give_up = time.monotonic() + seconds
        self.delay = 0.05

    def spent(self) -> bool:
        """Whether the next wait would end past the window: time to give up."""
        return time.monotonic() + self.delay > self.give_up

    async def wait(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(2 * self.delay, 0.5)
