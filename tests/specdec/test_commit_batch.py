"""Round commits batched per loop turn, against a real redis-server."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from specdec.commit_batch import pack_command
from specdec.errors import Unavailable
from specdec.rounds import Cursor
from specdec.session_store import PREFIX, SessionHandle, SessionStore


def test_pack_command_is_resp_as_redis_reads_it():
    assert pack_command(["SET", "k", 12, b"\x00\r\n"]) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$3\r\n\x00\r\n\r\n"


def _handles(n: int) -> list[SessionHandle]:
    return [SessionHandle(f"s{i}", "draft:1", "target:1", 1, [1, 2, 3], Cursor(2, 2, False), {"seed": i})
            for i in range(n)]


async def _sessions(url: str, n: int, retry_seconds: float = 5.0):
    """→ (client, store, n handles created in Redis)."""
    client = aioredis.from_url(url)
    store = SessionStore(client, ttl_seconds=30, commit_retry_seconds=retry_seconds)
    handles = _handles(n)
    for h in handles:
        await store.create(h)
    return client, store, handles


def _advance(store: SessionStore, handle: SessionHandle, new: list[int]):
    handle.committed.extend(new)
    handle.cursor = Cursor(handle.length - 1, handle.length - 1, False)
    return store.round_commit(handle, new)


def test_one_turns_commits_go_in_one_round_trip_and_each_lands(redis_server):
    """16 sessions answered together commit in one write; every handle reads back whole,
    including binary token bytes that hold \\r\\n."""
    async def go():
        client, store, handles = await _sessions(redis_server.url, 16)
        for k in range(3):
            trips = store._commits.round_trips
            # token 2573 is b"\x0d\x0a\x00\x00" in int32 little-endian: RESP's line end inside the bytes
            await asyncio.gather(*(store.commit(_advance(store, h, [2573, 100 * k + i])) for i, h in enumerate(handles)))
            # the first write finds the script not yet loaded (NOSCRIPT): loaded, then sent again
            assert store._commits.round_trips == trips + (2 if k == 0 else 1)
        for i, h in enumerate(handles):
            loaded = await store.load(h.session_id)
            assert loaded.committed == [1, 2, 3, 2573, i, 2573, 100 + i, 2573, 200 + i]
            assert loaded.cursor == Cursor(8, 8, False) and loaded.params == {"seed": i}
        await client.aclose()

    asyncio.run(go())


def test_a_failing_commit_fails_alone(redis_server):
    """One session's keys broken (its token key of the wrong type): its commit ends in
    Unavailable after the retry window, the others of its write land."""
    async def go():
        client, store, handles = await _sessions(redis_server.url, 4, 0.3)
        await client.delete(PREFIX + "s2:tokens")
        await client.hset(PREFIX + "s2:tokens", "x", "y")  # SETRANGE on it: WRONGTYPE
        results = await asyncio.gather(*(store.commit(_advance(store, h, [7])) for h in handles),
                                       return_exceptions=True)
        assert [r is True for r in results] == [True, True, False, True]  # True: committed
        assert isinstance(results[2], Unavailable) and "WRONGTYPE" in str(results[2])
        for h in handles[:2] + handles[3:]:
            assert (await store.load(h.session_id)).committed == [1, 2, 3, 7]
        await client.aclose()

    asyncio.run(go())


def test_commits_wait_out_a_redis_restart_and_reload_the_script(redis_server):
    """Commits sent while Redis is down land once it is back (it forgot the script: NOSCRIPT,
    loaded again), all in their places."""
    async def go():
        client, store, handles = await _sessions(redis_server.url, 3)
        await asyncio.gather(*(store.commit(_advance(store, h, [7])) for h in handles))
        redis_server.stop()

        async def back_in(seconds: float) -> None:
            await asyncio.sleep(seconds)
            redis_server.start()  # same directory: the append-only file keeps the handles

        restart = asyncio.create_task(back_in(0.4))
        await asyncio.gather(*(store.commit(_advance(store, h, [8, 9])) for h in handles))
        await restart
        for h in handles:
            assert (await store.load(h.session_id)).committed == [1, 2, 3, 7, 8, 9]
        await client.aclose()

    asyncio.run(go())


def test_commits_give_up_when_redis_stays_away(redis_server):
    async def go():
        client, store, (handle,) = await _sessions(redis_server.url, 1, 0.3)
        redis_server.stop()
        with pytest.raises(Unavailable, match="Redis is unavailable"):
            await store.commit(_advance(store, handle, [7]))
        await client.aclose()

    asyncio.run(go())


def test_an_unexpected_error_reaches_every_waiter_instead_of_stalling_them(redis_server, monkeypatch):
    """A fault that is not Redis's (here injected into the write) must not leave a round
    waiting forever for its commit."""
    from specdec.commit_batch import CommitBatcher

    async def broken(self, commands):
        raise ValueError("a fault in the write")

    async def go():
        client, store, handles = await _sessions(redis_server.url, 3)
        monkeypatch.setattr(CommitBatcher, "_round_trip", broken)
        results = await asyncio.wait_for(asyncio.gather(*(store.commit(_advance(store, h, [7])) for h in handles),
                                                        return_exceptions=True), 5)
        assert all(isinstance(r, Unavailable) and "a fault in the write" in str(r) for r in results)
        await client.aclose()

    asyncio.run(go())
