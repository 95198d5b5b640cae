"""The pool registry in Redis: replicas register, heartbeat with a TTL, deregister.

Each replica owns one key `specdec:replica:<pool>:<address>` holding its load report
(JSON) and expiring unless refreshed; a set per pool lists the members. A replica that
dies leaves by TTL; readers drop members whose key is gone.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from specdec.errors import Unavailable
from specdec.task_end import end_task

log = logging.getLogger(__name__)
PREFIX = "specdec:replica:"
POOLS = "specdec:pool:"


@dataclass
class ReplicaInfo:
    address: str
    pool: str
    capacity: int
    sessions: int = 0
    queue_length: int = 0
    cache_bytes: int = 0
    model: str = ""
    vocab_size: int = 0
    dtype: str = ""  # the weights' dtype as served (float32, bfloat16, ...)
    kernels: str = ""  # the forward's kernels: products by rows and attention (specdec.linear_kernels)
    frame_port: int = 0  # the port of its frame link (specdec.frames), on the address's host; 0: none
    updated: float = 0.0

    @classmethod
    def from_json(cls, text: str | bytes) -> "ReplicaInfo":
        """A registry entry; fields this version does not know (a newer replica's, in a
        rolling upgrade) are ignored rather than failing every read of the pool."""
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @property
    def load(self) -> float:
        return (self.sessions + self.queue_length) / max(1, self.capacity)


class Registry:
    def __init__(self, client: aioredis.Redis, ttl_seconds: float = 6.0) -> None:
        self.redis = client
        self.ttl = ttl_seconds

    async def register(self, info: ReplicaInfo) -> None:
        info.updated = time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(PREFIX + f"{info.pool}:{info.address}", json.dumps(asdict(info)), px=int(self.ttl * 1000))
            pipe.sadd(POOLS + info.pool, info.address)
            await pipe.execute()

    async def deregister(self, pool: str, address: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(PREFIX + f"{pool}:{address}")
            pipe.srem(POOLS + pool, address)
            await pipe.execute()

    async def live(self, pool: str) -> list[ReplicaInfo]:
        """The replicas of `pool` whose heartbeat entry has not expired; members whose entry
        has (a replica killed without deregistering) are dropped from the pool's set here, by
        whoever reads it first, so that no sweeper process is needed."""
        try:
            members = sorted(m.decode() for m in await self.redis.smembers(POOLS + pool))
            if not members:
                return []
            values = await self.redis.mget([PREFIX + f"{pool}:{m}" for m in members])
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc
        alive, dead = [], []
        for member, value in zip(members, values):
            if value is None:
                dead.append(member)
            else:
                alive.append(ReplicaInfo.from_json(value))
        if dead:
            try:
                await self.redis.srem(POOLS + pool, *dead)
            except RedisError:
                pass
        return alive


class Heartbeat:
    """Keeps one replica registered while its server runs; survives Redis outages."""

    def __init__(self, registry: Registry, report, interval: float = 2.0) -> None:
        self.registry = registry
        self.report = report  # () -> ReplicaInfo, the replica's current load
        self.interval = interval
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        warned = False
        while True:
            try:
                await self.registry.register(self.report())
                if warned:
                    log.info("registry: Redis reachable again, registered")
                warned = False
            except (RedisError, OSError) as exc:
                if not warned:
                    log.warning("registry: cannot register in Redis (%s); retrying every %.1fs", exc, self.interval)
                warned = True
            except Exception:  # a heartbeat that dies leaves the pool silently: log and go on
                log.exception("registry: heartbeat failed; retrying in %.1fs", self.interval)
                warned = True
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop heartbeating, then deregister. The task is ended for sure
        (specdec.task_end): one whose cancellation was dropped inside a Redis write would
        go on registering a replica that refuses every call."""
        await end_task(self._task)
        info = self.report()
        try:
            await self.registry.deregister(info.pool, info.address)
        except (RedisError, OSError):
            pass
