"""Session handles in a real redis-server: a round's commit, a load, a Redis restart, the
lease a call holds its session by."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from specdec.errors import SessionBusy, SessionNotFound
from specdec.rounds import Cursor
from specdec.session_store import EPHEMERAL, PARKED, PREFIX, AnswerScores, SessionHandle, SessionStore


def _handle() -> SessionHandle:
    return SessionHandle("s1", "draft:1", "target:1", 3, [11, 12, 13], Cursor(2, 2, False),
                         {"temperature": 1.0, "seed": 7})


async def _new_session(url: str) -> tuple[aioredis.Redis, SessionStore, SessionHandle]:
    client = aioredis.from_url(url)
    store = SessionStore(client, ttl_seconds=30)
    handle = _handle()
    await store.create(handle)
    return client, store, handle


async def _commit_rounds(store: SessionStore, handle: SessionHandle, rounds: list[list[int]]) -> None:
    for new in rounds:
        handle.committed.extend(new)
        handle.cursor = Cursor(handle.length - 1, handle.length - 1, False)
        await store.commit(store.round_commit(handle, new))


def test_rounds_commit_atomically_and_load_back(redis_server):
    async def go():
        client, store, handle = await _new_session(redis_server.url)
        await client.expire(PREFIX + "s1", 5)  # a commit refreshes both TTLs
        await _commit_rounds(store, handle, [[14], [15, 16, 17], [18, 19]])
        loaded = await store.load("s1")
        assert loaded.committed == [11, 12, 13, 14, 15, 16, 17, 18, 19]
        assert loaded.cursor == Cursor(8, 8, False)
        assert (loaded.draft_replica, loaded.target_replica, loaded.epoch) == ("draft:1", "target:1", 3)
        assert loaded.params == {"temperature": 1.0, "seed": 7}
        assert 25 < await client.ttl(PREFIX + "s1") <= 30
        assert 25 < await client.ttl(PREFIX + "s1:tokens") <= 30
        await client.aclose()

    asyncio.run(go())


def test_request_records_outlive_round_commits_and_the_policy_goes_with_them(redis_server):
    """The orchestrator's request records are written with the whole handle only, so a
    round's commit leaves them be; a seeded request's γ policy snapshot goes with every
    commit; a kept answer's handle can be given a shorter TTL."""
    async def go():
        client, store, handle = await _new_session(redis_server.url)
        handle.requests = [["r1", "fp", 3, -1]]
        await store.save(handle)
        handle.policy = '{"accepted": 3.0}'
        await _commit_rounds(store, handle, [[14, 15]])
        loaded = await store.load("s1")
        assert loaded.requests == [["r1", "fp", 3, -1]] and loaded.policy == '{"accepted": 3.0}'
        assert loaded.committed == [11, 12, 13, 14, 15]
        loaded.policy = ""
        await store.save(loaded, ttl=7)  # a new request's save drops the last one's snapshot
        again = await store.load("s1")
        assert again.policy == "" and again.requests == loaded.requests
        assert 0 < await client.ttl(PREFIX + "s1") <= 7 and 0 < await client.ttl(PREFIX + "s1:tokens") <= 7
        await client.aclose()

    asyncio.run(go())


def test_a_request_s_log_probabilities_commit_with_its_tokens_and_live_and_go_with_the_handle(redis_server):
    """Rounds that carry log-probabilities write them at their offset in their request's key,
    in the same script as the tokens (a round refused for another owner writes neither);
    a write of the whole handle gives them its TTL, and deleting the handle deletes them."""
    async def go():
        client, store, handle = await _new_session(redis_server.url)
        handle.requests = [["r1", "fp", 3, -1]]
        await store.save(handle)
        key = store.scores_key("s1", 3)
        for offset, data, token in ((0, b"AAAA", 14), (4, b"BBBBCCCC", 15)):
            handle.committed.append(token)
            await store.commit(store.round_commit(handle, [token], AnswerScores(3, offset, data)))
        assert await store.load_scores("s1", 3) == b"AAAABBBBCCCC" and 25 < await client.ttl(key) <= 30
        assert await store.load_scores("s1", 9) == b""
        handle.committed.append(16)
        refused = store.round_commit(handle, [16], AnswerScores(3, 12, b"DDDD"))
        await client.set(PREFIX + "s1:lock", "someone else")
        with pytest.raises(SessionBusy):
            await store.commit(refused)
        assert await store.load_scores("s1", 3) == b"AAAABBBBCCCC"
        assert (await store.load("s1")).committed == [11, 12, 13, 14, 15]
        await client.delete(PREFIX + "s1:lock")
        await store.save(handle, ttl=7)
        assert 0 < await client.ttl(key) <= 7
        assert await store.delete("s1", handle.answer_starts)
        assert not await client.exists(key)
        await client.aclose()

    asyncio.run(go())


def test_ephemeral_and_parked_sessions_are_listed_while_they_live(redis_server):
    async def go():
        client = aioredis.from_url(redis_server.url)
        store = SessionStore(client, ttl_seconds=30, orchestrator_id="orch-a")
        handle = _handle()
        handle.ephemeral = True
        await store.create(handle)
        kept = SessionHandle("kept", "d", "t", 1, [1, 2])
        await store.create(kept)
        assert await store.ephemeral_sessions() == {"s1": "orch-a"}
        await store.delete("s1")
        assert await store.ephemeral_sessions() == {} and not await client.exists(EPHEMERAL)
        await store.create(handle)
        await store.forget_ephemeral("s1")
        assert await store.ephemeral_sessions() == {}
        await store.park("s1", 0)
        await store.park("kept", 60)
        assert await store.parked_due(10) == ["s1"]  # the other's window has not passed
        await store.delete("s1")
        assert await store.parked_due(10) == [] and await client.zcard(PARKED) == 1
        await store.unpark("kept")
        assert not await client.exists(PARKED)
        await client.aclose()

    asyncio.run(go())


def test_a_lock_taken_for_a_session_not_there_yet_is_kept_for_its_creation(redis_server):
    async def go():
        client, store, _ = await _new_session(redis_server.url)
        assert await store.acquire("new", "me", create=True) is None
        with pytest.raises(SessionBusy):  # held for the caller, who creates the session
            await store.acquire("new", "other", create=True)
        with pytest.raises(SessionNotFound):
            await store.acquire("absent", "me")
        assert await store.try_lock("absent", "other")  # refused without create: not left locked
        await client.aclose()

    asyncio.run(go())


def test_commit_goes_on_after_redis_restarts(redis_server):
    """A restarted Redis has forgotten the commit script: the store loads it again."""
    async def go():
        client, store, handle = await _new_session(redis_server.url)
        await _commit_rounds(store, handle, [[14, 15]])
        redis_server.stop()
        redis_server.start()  # same port and directory: the append-only file keeps the handle
        fresh = aioredis.from_url(redis_server.url)
        assert await fresh.script_exists(store._commits.sha) == [False]
        await _commit_rounds(store, handle, [[16]])  # the old connection broke: retried
        assert await fresh.script_exists(store._commits.sha) == [True]
        await fresh.aclose()
        assert (await store.load("s1")).committed == [11, 12, 13, 14, 15, 16]
        await client.aclose()

    asyncio.run(go())


def test_a_lock_is_released_by_its_owner_only_and_across_a_redis_blip(redis_server):
    """unlock retries while Redis is away: a lock left behind at the end of a call would
    refuse the session's next call until it expired (the e2e Redis restart found one)."""
    async def go():
        client, store, _ = await _new_session(redis_server.url)
        assert await store.try_lock("s1", "call-a")
        assert not await store.try_lock("s1", "call-b")  # one generation at a time
        await store.unlock("s1", "call-b")  # not the owner: the lock stays
        assert not await store.try_lock("s1", "call-b")
        redis_server.stop()

        async def back_in(seconds: float) -> None:
            await asyncio.sleep(seconds)
            redis_server.start()  # same port and directory: the append-only file keeps the lock

        restart = asyncio.create_task(back_in(0.5))
        await store.unlock("s1", "call-a")  # issued while Redis is down
        await restart
        assert await store.try_lock("s1", "call-b")  # released, not left to expire
        await client.aclose()

    asyncio.run(go())


def test_a_handle_is_deleted_across_a_redis_blip(redis_server):
    """delete retries while Redis is away: an ephemeral session whose call ended as Redis
    restarted left its handle in Redis until the TTL (the e2e Redis restart found one)."""
    async def go():
        client, store, _ = await _new_session(redis_server.url)
        redis_server.stop()

        async def back_in(seconds: float) -> None:
            await asyncio.sleep(seconds)
            redis_server.start()  # same port and directory: the append-only file keeps the handle

        restart = asyncio.create_task(back_in(0.5))
        assert await store.delete("s1")  # issued while Redis is down
        await restart
        with pytest.raises(SessionNotFound):
            await store.load("s1")
        await client.aclose()

    asyncio.run(go())


def _commit_one(store: SessionStore, handle: SessionHandle, token: int):
    handle.committed.append(token)
    handle.cursor = Cursor(handle.length - 1, handle.length - 1, False)
    return store.commit(store.round_commit(handle, [token]))


def test_a_session_is_held_by_one_call_and_each_commit_renews_the_lease(redis_server):
    async def go():
        client = aioredis.from_url(redis_server.url)
        store = SessionStore(client, ttl_seconds=30, lease_seconds=1.0)
        await store.create(_handle())
        held = await store.acquire("s1", "call-a")
        assert held.owner == "call-a" and held.committed == [11, 12, 13]
        with pytest.raises(SessionBusy, match="in use by another call"):
            await store.acquire("s1", "call-b")
        for token in (14, 15, 16):  # 1.5 leases in all: each commit renews it
            await asyncio.sleep(0.5)
            assert await _commit_one(store, held, token)
            assert 800 < await client.pttl(PREFIX + "s1:lock") <= 1000
        assert (await store.load("s1")).committed == [11, 12, 13, 14, 15, 16]
        await store.unlock("s1", "call-a")
        assert (await store.acquire("s1", "call-b")).owner == "call-b"
        await client.aclose()

    asyncio.run(go())


def test_a_call_whose_lease_lapsed_cannot_write_over_the_call_that_took_the_session(redis_server):
    async def go():
        client = aioredis.from_url(redis_server.url)
        store = SessionStore(client, ttl_seconds=30, lease_seconds=0.2)
        await store.create(_handle())
        first = await store.acquire("s1", "call-a")
        await asyncio.sleep(0.3)  # a hung round: the lease lapses ...
        second = await store.acquire("s1", "call-b")  # ... and another call continues the session
        assert await _commit_one(store, second, 20)
        with pytest.raises(SessionBusy, match="taken over by another call"):
            await _commit_one(store, first, 99)
        assert (await store.load("s1")).committed == [11, 12, 13, 20]
        assert await client.get(PREFIX + "s1:lock") == b"call-b"
        await client.aclose()

    asyncio.run(go())


def test_a_lapsed_lease_nobody_took_is_taken_again_by_the_next_commit(redis_server):
    async def go():
        client = aioredis.from_url(redis_server.url)
        store = SessionStore(client, ttl_seconds=30, lease_seconds=0.2)
        await store.create(_handle())
        held = await store.acquire("s1", "call-a")
        await asyncio.sleep(0.3)
        assert await client.get(PREFIX + "s1:lock") is None
        assert await _commit_one(store, held, 14)
        assert await client.get(PREFIX + "s1:lock") == b"call-a"
        await client.aclose()

    asyncio.run(go())


def test_a_commit_never_brings_back_a_handle_that_is_gone(redis_server):
    """Before the lease, a commit after the handle was lost (a Redis that lost its last
    writes, a handle deleted) wrote it again as zero tokens up to the round's offset."""
    async def go():
        client = aioredis.from_url(redis_server.url)
        store = SessionStore(client, ttl_seconds=30)
        await store.create(_handle())
        held = await store.acquire("s1", "call-a")
        await client.delete(PREFIX + "s1", PREFIX + "s1:tokens", PREFIX + "s1:lock")
        assert not await _commit_one(store, held, 14)
        assert await client.keys(PREFIX + "s1*") == []
        await store.create(held)  # what a generation does then: the whole handle again, its lease with it
        assert (await store.load("s1")).committed == [11, 12, 13, 14]
        assert await client.get(PREFIX + "s1:lock") == b"call-a"
        await client.aclose()

    asyncio.run(go())


def test_acquiring_an_unknown_session_leaves_no_lock(redis_server):
    async def go():
        client = aioredis.from_url(redis_server.url)
        store = SessionStore(client, ttl_seconds=30)
        with pytest.raises(SessionNotFound):
            await store.acquire("nope", "call-a")
        assert await client.keys(PREFIX + "*") == []
        await client.aclose()

    asyncio.run(go())
