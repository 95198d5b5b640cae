"""The retry window the Redis commands that may run twice share."""
import asyncio
import time

from specdec.retry import RetryWindow


def test_waits_double_up_to_half_a_second_and_stop_at_the_window():
    async def run():
        window, waits = RetryWindow(0.4), []
        while not window.spent():
            waits.append(window.delay)
            await window.wait()
        return waits, window.give_up

    t0 = time.monotonic()
    waits, give_up = asyncio.run(run())
    assert waits == [0.05, 0.1, 0.2]  # a fourth wait of 0.4 s would end past the window
    assert time.monotonic() <= give_up and time.monotonic() - t0 >= 0.35


def test_the_delay_is_capped_at_half_a_second():
    async def run():
        window = RetryWindow(60)
        for _ in range(4):  # 0.05, 0.1, 0.2, 0.4 s
            await window.wait()
        return window.delay

    assert asyncio.run(run()) == 0.5
