"""Routing over a real registry in a real redis-server: a replica whose call failed is
avoided while another can serve, and a pool whose every replica is avoided is tried again
rather than refusing every new session."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from orchestrator.pools import PoolClients
from specdec.errors import Unavailable
from specdec.registry import Registry, ReplicaInfo

A, B = "127.0.0.1:1", "127.0.0.1:2"


async def pools_over(redis_url: str, *addresses: str) -> tuple[PoolClients, aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    registry = Registry(client, ttl_seconds=30)
    for address in addresses:
        await registry.register(ReplicaInfo(address, "target", capacity=8))
    return PoolClients(registry, registry_cache_seconds=0), client


def test_a_replica_marked_down_is_avoided_while_another_serves(redis_server):
    async def go():
        pools, client = await pools_over(redis_server.url, A, B)
        try:
            pools.mark_down(A)
            return {await pools.pick("target") for _ in range(4)}
        finally:
            await pools.close()
            await client.aclose()

    assert asyncio.run(go()) == {B}


def test_a_pool_whose_every_replica_is_marked_down_is_tried_again(redis_server):
    """One failed call marks its replica down for 10 s. Before, with both replicas of the
    pool so marked, every new session failed UNAVAILABLE at once until a mark expired,
    although both were registered and heartbeating."""
    async def go():
        pools, client = await pools_over(redis_server.url, A, B)
        try:
            pools.mark_down(A)
            pools.mark_down(B)
            assert pools.is_down(A) and pools.is_down(B)
            return {await pools.require("target") for _ in range(4)}
        finally:
            await pools.close()
            await client.aclose()

    picked = asyncio.run(go())
    assert picked and picked <= {A, B}


def test_an_empty_pool_is_unavailable_with_what_to_do(redis_server):
    async def go():
        pools, client = await pools_over(redis_server.url)
        try:
            with pytest.raises(Unavailable, match="no live target replica is registered in pool 'target'"):
                await pools.require("target")
        finally:
            await pools.close()
            await client.aclose()

    asyncio.run(go())


def test_a_call_does_not_try_again_the_replicas_it_found_down(redis_server):
    """Failing open must not loop a call over replicas that failed it: one whose every
    registered replica it found down is refused at once, saying so."""
    async def go():
        pools, client = await pools_over(redis_server.url, A, B)
        try:
            pools.mark_down(A)
            pools.mark_down(B)
            assert await pools.pick("target", exclude={A}) == B
            with pytest.raises(Unavailable, match="no live target replica is registered in pool 'target' "
                                                  "beyond the 2 that failed this call"):
                await pools.require("target", exclude={A, B})
        finally:
            await pools.close()
            await client.aclose()

    asyncio.run(go())


def test_prompts_that_begin_alike_go_to_one_replica_unless_it_is_fuller(redis_server):
    """Prefix affinity: among replicas within AFFINITY_SLACK of the least loaded, a new
    session's prompt start picks the same one every time (where the replicas' prefix reuse
    finds it held); other starts spread over both; a replica fuller than the slack allows
    is passed over; and a prompt too short to be reused is routed by load alone."""
    from orchestrator.pools import prefix_affinity

    async def go():
        pools, client = await pools_over(redis_server.url, A, B)
        registry = Registry(client, ttl_seconds=30)
        try:
            keys = [prefix_affinity(list(range(k, k + 20))) for k in range(24)]
            firsts = {key: await pools.pick("target", affinity=key) for key in keys}
            again = {key: await pools.pick("target", affinity=key) for key in keys}
            to_a = next(key for key, address in firsts.items() if address == A)
            await registry.register(ReplicaInfo(A, "target", capacity=8, sessions=2))  # 0.25 fuller than B
            moved = await pools.pick("target", affinity=to_a)
            return firsts, again, moved
        finally:
            await pools.close()
            await client.aclose()

    firsts, again, moved = asyncio.run(go())
    assert firsts == again and set(firsts.values()) == {A, B}
    assert moved == B
    assert prefix_affinity(list(range(16))) == b"" and len(prefix_affinity(list(range(17)))) == 16 * 8


@pytest.mark.parametrize("affinity", [True, False])
def test_prefix_affinity_off_routes_by_load_alone(redis_server, affinity):
    """A replica a little fuller (within the slack) still gets the prompts that hash to it,
    unless the orchestrator routes by load alone (`--prefix-affinity off`)."""
    from orchestrator.pools import prefix_affinity

    async def go():
        pools, client = await pools_over(redis_server.url, A, B)
        pools.prefix_affinity = affinity
        try:
            await Registry(client, ttl_seconds=30).register(ReplicaInfo(A, "target", capacity=100, sessions=5))
            keys = [prefix_affinity(list(range(k, k + 20))) for k in range(24)]
            picks = []
            for key in keys:  # a fresh count of placements each time: the registry's loads decide
                pools._placed.clear()
                picks.append(await pools.pick("target", affinity=key))
            return picks
        finally:
            await pools.close()
            await client.aclose()

    picks = asyncio.run(go())
    assert (set(picks) == {A, B}) if affinity else (picks == [B] * len(picks))
