"""The micro-batcher's scheduling: lone calls never wait, a loaded batch waits briefly for
the sessions of the last batches that are due back (not for those busy elsewhere), small
batches run on the event loop's thread."""
import asyncio
import threading
import time

from specdec.batcher import MicroBatcher


class Recorder:
    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.batches: list[list[str]] = []
        self.threads: list[str] = []

    def __call__(self, jobs: list[str]) -> list[str]:
        self.batches.append(list(jobs))
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)
        return [j.upper() for j in jobs]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def session(job: str) -> str:
    return job[0]  # "a1" belongs to session "a"


async def two_sessions_away(batcher: MicroBatcher, away: float) -> None:
    """Sessions a and b each make two calls together, `away` seconds apart: the batcher
    learns that both are usually that long away between calls (in the other pool)."""
    await asyncio.gather(batcher.submit("a0"), batcher.submit("b0"))
    await asyncio.sleep(away)
    await asyncio.gather(batcher.submit("a1"), batcher.submit("b1"))


def test_a_lone_session_never_waits_for_company():
    async def main():
        rec = Recorder(0.05)
        batcher = MicroBatcher(rec, key=session, max_wait_ms=60_000, gather=1e6)
        batcher.start()
        for i in range(3):  # with a 60 s hold allowed, each call would stall if it were held
            assert await asyncio.wait_for(batcher.submit(f"a{i}"), 5) == f"A{i}"
        await batcher.stop()
        return rec.batches

    assert run(main()) == [["a0"], ["a1"], ["a2"]]


def test_a_loaded_batch_waits_for_the_sessions_of_the_last_batch():
    async def main():
        rec = Recorder(0.05)
        batcher = MicroBatcher(rec, key=session, max_wait_ms=60_000, gather=1e6)
        batcher.start()
        await asyncio.gather(batcher.submit("a0"), batcher.submit("b0"))  # one batch of both
        first = asyncio.ensure_future(batcher.submit("a1"))
        await asyncio.sleep(0.3)  # b is late: a1 is held for it, not run alone
        assert not first.done()
        await asyncio.wait_for(asyncio.gather(first, batcher.submit("b1")), 5)
        await batcher.stop()
        return rec.batches

    assert run(main()) == [["a0", "b0"], ["a1", "b1"]]


def test_a_batch_already_feeding_full_tokens_is_not_held():
    """Past `full_tokens` rows a forward costs about in proportion to its rows (a CPU's
    products): a1 feeding 5 tokens runs at once with a limit of 4, and is held for b under
    no limit, as above."""
    async def main(full: int):
        rec = Recorder(0.05)
        batcher = MicroBatcher(rec, key=session, max_wait_ms=60_000, gather=1e6, size=lambda job: 5,
                               full_tokens=full)
        batcher.start()
        await asyncio.gather(batcher.submit("a0"), batcher.submit("b0"))
        first = asyncio.ensure_future(batcher.submit("a1"))
        await asyncio.sleep(0.3)
        held = not first.done()
        await asyncio.wait_for(asyncio.gather(first, batcher.submit("b1")), 5)
        await batcher.stop()
        return held, rec.batches

    assert run(main(4)) == (False, [["a0", "b0"], ["a1"], ["b1"]])
    assert run(main(0)) == (True, [["a0", "b0"], ["a1", "b1"]])
    assert run(main(11)) == (True, [["a0", "b0"], ["a1", "b1"]])  # 5 tokens: not full yet


def test_the_full_tokens_default_is_for_a_cpu_only():
    from specdec.batcher import CPU_FULL_TOKENS, full_tokens

    assert full_tokens(-1, "cpu") == CPU_FULL_TOKENS > 0
    assert full_tokens(-1, "cuda") == 0  # a GPU's forwards read every weight up to far larger batches
    assert full_tokens(0, "cpu") == 0 and full_tokens(40, "cuda") == 40


def test_the_hold_is_bounded():
    async def main():
        rec = Recorder(0.02)
        batcher = MicroBatcher(rec, key=session, max_wait_ms=100, gather=1e6)
        batcher.start()
        await asyncio.gather(batcher.submit("a0"), batcher.submit("b0"))
        t0 = time.monotonic()
        await batcher.submit("a1")  # b never comes back: a1 runs once the 100 ms are up
        waited = time.monotonic() - t0
        await batcher.stop()
        return rec.batches, waited

    batches, waited = run(main())
    assert batches == [["a0", "b0"], ["a1"]]
    assert waited < 5


def test_a_session_busy_elsewhere_is_not_waited_for():
    async def main():
        rec = Recorder()
        batcher = MicroBatcher(rec, key=session, max_wait_ms=300, gather=1e6)
        batcher.start()
        await two_sessions_away(batcher, 0.5)
        t0 = time.monotonic()
        await batcher.submit("a2")  # b is not due back for 0.5 s, past the 0.3 s hold: a2 goes alone
        waited = time.monotonic() - t0
        await batcher.stop()
        return rec.batches, waited

    batches, waited = run(main())
    assert batches == [["a0", "b0"], ["a1", "b1"], ["a2"]]
    assert waited < 0.15  # not held for the whole 0.3 s


def test_a_session_due_back_within_the_hold_is_waited_for():
    async def main():
        rec = Recorder()
        batcher = MicroBatcher(rec, key=session, max_wait_ms=1000, gather=1e6)
        batcher.start()
        await two_sessions_away(batcher, 0.2)
        first = asyncio.ensure_future(batcher.submit("a2"))
        await asyncio.sleep(0.1)  # quiet slices pass, but b is due: a2 waits for it
        assert not first.done()
        await asyncio.wait_for(asyncio.gather(first, batcher.submit("b2")), 5)
        await batcher.stop()
        return rec.batches

    assert run(main())[-1] == ["a2", "b2"]


def test_small_batches_run_on_the_loop_thread_and_big_ones_on_the_worker():
    async def main():
        rec = Recorder()
        batcher = MicroBatcher(rec, size=len, inline_up_to=4)
        batcher.start()
        await batcher.submit("abc")
        await batcher.submit("abcdefgh")
        await batcher.stop()
        return rec.threads

    loop_thread, worker = run(main())
    assert loop_thread == threading.main_thread().name
    assert worker.startswith("engine")


def test_a_stop_that_lands_with_a_new_call_still_stops():
    """A batch held for company is waiting on the wake-up event when the replica stops, and
    a call arrives in the same turn as the stop's cancellation. Python 3.11's
    asyncio.wait_for returned the event's result there and dropped the cancellation, so the
    worker went on and `stop` waited for it for ever: a target replica hung in its drain."""
    async def main():
        rec = Recorder()
        batcher = MicroBatcher(rec, key=session, max_wait_ms=60_000, gather=1e6, quiet_ms=60_000)
        batcher.start()
        await asyncio.gather(batcher.submit("a0"), batcher.submit("b0"))  # one batch of both
        held = asyncio.ensure_future(batcher.submit("a1"))  # held for b
        await asyncio.sleep(0.1)
        assert not held.done()
        loop = asyncio.get_running_loop()
        batcher._queue.append(("b1", loop.create_future()))  # b's call, as submit queues it
        batcher._wakeup.set()
        t0 = loop.time()
        async with asyncio.timeout(2):  # a stop that hangs is cut short here ...
            await batcher.stop()  # ... which cancels in this same turn
        assert batcher._worker.done()
        assert loop.time() - t0 < 1.5  # ... and would not return before then
        held.cancel()

    run(main())


def test_a_release_fails_its_sessions_queued_calls_and_waits_out_its_running_one():
    """settle(session): its calls still queued fail with the error given (run after the
    Release they would make the session anew), others run; and it returns only once a
    batch running one of its calls has ended."""
    async def main():
        rec = Recorder(0.2)
        batcher = MicroBatcher(rec, key=session)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit("a0"))  # runs at once, for 0.2 s
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(batcher.submit(job)) for job in ("b0", "a1", "b1")]
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        failed = await batcher.settle("a", RuntimeError("released"))
        waited = time.monotonic() - t0
        results = await asyncio.gather(first, *queued, return_exceptions=True)
        assert await batcher.settle("c", RuntimeError("released")) == 0  # a session with no call: at once
        await batcher.stop()
        return failed, waited, results, rec.batches

    failed, waited, results, batches = run(main())
    assert failed == 1 and waited >= 0.1  # a0's batch had about 0.15 s left
    assert results[0] == "A0" and results[1] == "B0" and results[3] == "B1"
    assert isinstance(results[2], RuntimeError) and str(results[2]) == "released"
    assert batches == [["a0"], ["b0", "b1"]]  # a1 never ran
