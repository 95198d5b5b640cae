"""DraftWaits on its own: how long a draft call is waited for, the stall marks a late call
leaves on its replica, and what a late proposal that does come tells the draft cursor.
(tests/e2e/test_stalled_replicas.py pauses real replicas.)"""
import asyncio

from orchestrator.draft_waits import DraftWaits
from orchestrator.gamma_policy import SessionPolicy
from orchestrator.loop_state import Generation, Proposal, Stats
from specdec.session_store import SessionHandle
from specdec.sessions import CacheRef


def generation(replica: str = "draft-a:1", deterministic: bool = False, committed: int = 10) -> Generation:
    handle = SessionHandle("s", replica, "target-a:1", 1, list(range(committed)))
    policy = SessionPolicy(deterministic=deterministic)
    return Generation(handle, None, None, Stats(), policy, None, None, 0.0, committed, 0.0)


def test_an_answer_in_time_is_returned_and_marks_nothing():
    async def go():
        waits, gen = DraftWaits(0.2), generation()
        got = await waits.in_time(gen, asyncio.ensure_future(asyncio.sleep(0.01, result="proposal")))
        return got, gen.late, waits.stalled("draft-a:1"), waits.ready(gen)

    assert asyncio.run(go()) == ("proposal", None, False, True)


def test_a_late_call_stalls_its_replica_for_every_session_until_it_ends():
    async def go():
        waits = DraftWaits(0.02)
        gen, other, elsewhere = generation(), generation(), generation("draft-b:1")
        ended = asyncio.Event()

        async def call():
            await ended.wait()
            return None

        task = asyncio.ensure_future(call())
        got = await waits.in_time(gen, task)
        during = (got, gen.late is task, waits.ready(gen), waits.ready(other), waits.ready(elsewhere))
        ended.set()
        await task
        after = (waits.ready(gen), gen.late, waits.ready(other), waits.stalled("draft-a:1"))
        return during, after

    during, after = asyncio.run(go())
    assert during == (None, True, False, False, True)
    assert after == (True, None, True, False)


def test_a_seeded_sampled_session_waits_the_call_out_and_ignores_stall_marks():
    async def go():
        waits = DraftWaits(0.01)
        seeded, other = generation(deterministic=True), generation()
        blocker = asyncio.ensure_future(asyncio.sleep(0.2))
        await waits.in_time(other, blocker)  # marks draft-a:1 stalled
        got = await waits.in_time(seeded, asyncio.ensure_future(asyncio.sleep(0.05, result="kept")))
        ready = waits.ready(seeded), waits.ready(other)
        blocker.cancel()
        return got, ready, waits.wait_for(seeded), waits.wait_for(other)

    assert asyncio.run(go()) == ("kept", (True, False), None, 0.01)


def test_the_wait_grows_with_the_calls_a_chunked_feed_makes():
    async def go():
        waits, gen = DraftWaits(0.03), generation()
        return await waits.in_time(gen, asyncio.ensure_future(asyncio.sleep(0.06, result="fed")), calls=3)

    assert asyncio.run(go()) == "fed"


def test_a_late_proposal_that_comes_moves_the_draft_cursor_but_not_past_the_committed_tokens():
    async def go(fed: int, committed: int):
        waits, gen = DraftWaits(0.01), generation(committed=committed)
        gen.handle.cursor.draft_len = 2
        proposal = Proposal(None, CacheRef("s", 1, 2, list(range(2, fed))), 1.0)
        task = asyncio.ensure_future(asyncio.sleep(0.05, result=proposal))
        assert await waits.in_time(gen, task) is None
        await task
        assert waits.ready(gen)
        return gen.handle.cursor.draft_len

    assert asyncio.run(go(fed=8, committed=12)) == 8
    assert asyncio.run(go(fed=12, committed=12)) == 11  # the last committed token is fed by the next round's call


def test_background_tasks_are_held_until_they_end():
    async def go():
        waits = DraftWaits(0.01)

        async def fails():
            await asyncio.sleep(0.01)
            raise RuntimeError("replica gone")

        task = asyncio.ensure_future(fails())
        waits.in_background(task)
        held = task in waits._background
        await asyncio.wait([task])
        await asyncio.sleep(0)
        return held, task in waits._background

    assert asyncio.run(go()) == (True, False)
