"""The pool registry in a real redis-server: what a replica reports, as others read it."""
from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from specdec.registry import POOLS, PREFIX, Heartbeat, Registry, ReplicaInfo


def test_entries_round_trip_with_their_dtype_and_unknown_fields_are_ignored(redis_server):
    """A replica of a newer version may report fields this one does not know (a rolling
    upgrade): the pool must still read, not fail on every entry."""
    async def go():
        client = aioredis.from_url(redis_server.url)
        try:
            registry = Registry(client, ttl_seconds=30)
            await registry.register(ReplicaInfo("127.0.0.1:1", "target", 8, model="m", vocab_size=10,
                                                dtype="bfloat16"))
            newer = {"address": "127.0.0.1:2", "pool": "target", "capacity": 4, "a_later_field": [1, 2]}
            await client.set(PREFIX + "target:127.0.0.1:2", json.dumps(newer), px=30000)
            await client.sadd(POOLS + "target", "127.0.0.1:2")
            return sorted(await registry.live("target"), key=lambda info: info.address)
        finally:
            await client.aclose()

    first, second = asyncio.run(go())
    assert (first.address, first.dtype, first.vocab_size) == ("127.0.0.1:1", "bfloat16", 10)
    assert (second.address, second.capacity, second.dtype) == ("127.0.0.1:2", 4, "")


def test_a_stopped_heartbeat_has_ended_and_deregistered(redis_server):
    """Beating every 10 ms, the stop's cancellation often lands inside a Redis write, where
    redis-py's asyncio.wait_for may drop it on Python 3.11: the heartbeat must still end,
    and not register the replica again after its deregistration."""
    async def go():
        client = aioredis.from_url(redis_server.url, socket_timeout=2.0)
        try:
            registry = Registry(client, ttl_seconds=30)
            seen = []
            for i in range(5):
                info = ReplicaInfo(f"127.0.0.1:{10 + i}", "hb", 8)
                beat = Heartbeat(registry, lambda info=info: info, interval=0.01)
                beat.start()
                await asyncio.sleep(0.05 + 0.013 * i)
                registered = info.address in [r.address for r in await registry.live("hb")]
                async with asyncio.timeout(5):
                    await beat.stop()
                await asyncio.sleep(0.05)  # a heartbeat still running would have registered again
                seen.append((registered, beat._task.done(), [r.address for r in await registry.live("hb")]))
            return seen
        finally:
            await client.aclose()

    for registered, ended, left in asyncio.run(go()):
        assert registered and ended and left == []
