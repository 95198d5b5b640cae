"""Session handles in a real redis-server: a round's commit, a load, a Redis restart."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from specdec.rounds import Cursor
from specdec.session_store import PREFIX, SessionHandle, SessionStore


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
