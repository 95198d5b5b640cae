"""The orchestrator's heartbeat (orchestrator/reaper.py) in a real redis-server. Its release
of dead orchestrators' sessions runs against whole stacks in tests/e2e/test_reaper.py."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import redis.asyncio as aioredis

from orchestrator.reaper import ALIVE_PREFIX, ORCHESTRATORS, Reaper
from specdec.session_store import SessionStore


def test_a_stopped_reaper_has_ended_and_says_its_orchestrator_is_gone(redis_server):
    """Beating every 10 ms, the stop's cancellation often lands inside a Redis write, where
    redis-py's asyncio.wait_for may drop it on Python 3.11. Before: stop() cancelled the loop
    once and awaited it, and an orchestrator's drain could wait there for ever (CI: a
    drained orchestrator not exiting within 15 s of its streams' end)."""
    async def go():
        client = aioredis.from_url(redis_server.url, socket_timeout=2.0)
        try:
            seen = []
            for i in range(8):
                reaper = Reaper(SimpleNamespace(store=SessionStore(client, 60)), client, f"o{i}", interval=0,
                                beat_s=0.01)
                await reaper.start()
                await asyncio.sleep(0.05 + 0.013 * i)
                alive = await client.exists(ALIVE_PREFIX + reaper.id)
                async with asyncio.timeout(5):
                    await reaper.stop()
                await asyncio.sleep(0.05)  # a loop still running would have beaten again
                seen.append((alive, reaper._task.done(), await client.exists(ALIVE_PREFIX + reaper.id),
                             await client.sismember(ORCHESTRATORS, reaper.id)))
            return seen
        finally:
            await client.aclose()

    for alive, ended, alive_after, listed in asyncio.run(go()):
        assert alive and ended and not alive_after
        assert listed  # kept listed: the others drop it once none of its sessions is left
