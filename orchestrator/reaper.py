"""Sessions whose caches nobody would release soon: those an orchestrator that died left
running, and those of cut answers kept for a retry that has not come.

A session that no later call can name (not kept, no request id) is released by the call
that runs it, at its end. If that call's orchestrator dies (a crash, an OOM kill, a node
lost), nobody releases it: its handle stayed in Redis until `--session-ttl` (600 s) and its
caches on both replicas until their idle expiry, holding memory a replica's live sessions
need. Now every orchestrator keeps a heartbeat key in Redis (renewed every `BEAT_S`, expiring
after `ALIVE_S`) and its id in a set of them (`ORCHESTRATORS`), lists each such session
beside its own id while it runs (`session_store.EPHEMERAL`), and every `interval` seconds
checks the others' heartbeats; only where one is gone does it read the listing, to release
that orchestrator's sessions, and it drops the id once none is left: caches on both replicas and the handle, as the dead
call's end would have. The session's lease decides who does it, and when: a session is
taken only once the dead call's lease has run out (`--session-lease`), and only by one
orchestrator. A live orchestrator's sessions are never taken, however long one of its
rounds lasts (tests/e2e/test_reaper.py); and one whose heartbeat lapsed (an event loop held
for seconds) loses only a session whose lease lapsed too, no round committed for as long.

A request with an id whose answer was cut (a cancelled stream, a deadline) keeps its session
for the retry to continue (orchestrator/request_ids.py). Its caches stayed on both replicas
until their idle expiry (`--session-idle-seconds`, 600 s) whether or not a retry came; now
the call lists it (`session_store.PARKED`) with the end of its retry window
(`--retry-window`), and once that has passed with no retry running, the caches are released
and the handle kept without replicas: a later retry still continues the answer, from caches
built again.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Awaitable, Callable

from redis.exceptions import RedisError

from specdec import metrics
from specdec.errors import SessionNotFound, SpecDecError
from specdec.session_store import SessionHandle
from specdec.task_end import end_task

log = logging.getLogger(__name__)
ALIVE_PREFIX = "specdec:orchestrator:"
ORCHESTRATORS = "specdec:orchestrators"  # the ids of the orchestrators that beat, alive or not reaped yet
BEAT_S = 1.0  # how often an orchestrator renews its heartbeat
ALIVE_S = 5  # how long a heartbeat lasts unrenewed: an orchestrator silent this long is dead
INTERVAL_S = 2.0  # how often the listed sessions are checked
MAX_PER_PASS = 64  # sessions released per check at most, so that one pass stays short


class Reaper:
    """One orchestrator's heartbeat, and its share of releasing the dead ones' sessions."""

    def __init__(self, generator, redis, orchestrator_id: str, interval: float = INTERVAL_S,
                 beat_s: float = BEAT_S) -> None:
        self.generator = generator  # releases a session as a call's end does (Generator.release)
        self.store = generator.store
        self.redis = redis
        self.id = orchestrator_id
        self.interval = interval  # 0: no reaping (the heartbeat still beats)
        self.beat_s = beat_s
        self._task: asyncio.Task | None = None

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:16]

    async def start(self) -> None:
        """The first heartbeat, before this orchestrator lists any session, then the loop."""
        try:
            await self._beat()
        except RedisError as exc:  # the loop beats again in a second
            log.warning("session reaper: %s", exc)
        self._task = asyncio.ensure_future(self._run())

    async def _beat(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(ALIVE_PREFIX + self.id, "1", ex=ALIVE_S)
            pipe.sadd(ORCHESTRATORS, self.id)
            await pipe.execute()

    async def stop(self) -> None:
        """Stop beating and say so at once: this orchestrator's sessions left over (a drain
        cut short) are released by the others without waiting for the heartbeat to lapse."""
        await end_task(self._task)  # cancelled until ended: one cancel can be dropped (specdec/task_end.py)
        try:
            await self.redis.delete(ALIVE_PREFIX + self.id)
        except RedisError:
            pass

    async def _run(self) -> None:
        checked = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.beat_s)
            try:
                await self._beat()
                if self.interval and loop.time() - checked >= self.interval:
                    checked = loop.time()
                    await self.reap_once()
            except (RedisError, SpecDecError) as exc:
                log.warning("session reaper: %s", exc)
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any failure of a pass
                log.exception("session reaper: a pass failed")

    async def reap_once(self) -> int:
        """Release the listed sessions of dead orchestrators whose lease has run out → how many."""
        reaped = 0
        for session_id in await self.store.parked_due(MAX_PER_PASS):
            reaped += await self._unpark(session_id)
        others = sorted({m.decode() for m in await self.redis.smembers(ORCHESTRATORS)} - {self.id})
        if not others:
            return reaped
        async with self.redis.pipeline(transaction=False) as pipe:
            for other in others:
                pipe.exists(ALIVE_PREFIX + other)
            dead = {other for other, alive in zip(others, await pipe.execute()) if not alive}
        if not dead:  # the usual case: the listing is not read at all
            return reaped
        left = {other: [] for other in dead}
        for session_id, owner in (await self.store.ephemeral_sessions()).items():
            if owner in left:
                left[owner].append(session_id)
        for other, sessions in left.items():
            if not sessions:  # all released: no more to look for
                await self.redis.srem(ORCHESTRATORS, other)
            for session_id in sessions[:max(0, MAX_PER_PASS - reaped)]:
                reaped += await self._reap(session_id, other)
        return reaped

    async def _take(self, session_id: str, forget: Callable[[str], Awaitable[None]]) -> SessionHandle | None:
        """The session, held under a lease of this reaper's own → its handle; None where a
        call (or another reaper) holds it, or where it is gone (then `forget` drops its
        listing)."""
        owner = "reaper-" + uuid.uuid4().hex
        if not await self.store.try_lock(session_id, owner):
            return None
        try:
            handle = await self.store.load(session_id)
        except SessionNotFound:  # released, or expired, without its listing
            await forget(session_id)
            await self.store.unlock(session_id, owner)
            return None
        handle.owner = owner
        return handle

    async def _reap(self, session_id: str, orchestrator: str) -> bool:
        """Release a dead orchestrator's session, caches and handle, once its call's lease ran out."""
        handle = await self._take(session_id, self.store.forget_ephemeral)
        if handle is None:
            return False
        await self.generator.release(handle)
        metrics.SESSIONS_REAPED.labels("orchestrator_died").inc()
        log.info("released session %s of orchestrator %s, which stopped without releasing it", session_id,
                 orchestrator)
        return True

    async def _unpark(self, session_id: str) -> bool:
        """Release a parked session's caches, keeping its handle for a later retry; a retry
        running now is left alone (cut again, it parks the session anew)."""
        handle = await self._take(session_id, self.store.unpark)
        if handle is None:
            return False
        await self.store.unpark(session_id)
        if not (handle.draft_replica or handle.target_replica):  # answered whole since, or released
            await self.store.unlock(session_id, handle.owner)
            return False
        await self.generator.release(handle, keep_handle=True, handle_ttl=self.store.ttl)
        metrics.SESSIONS_REAPED.labels("retry_window").inc()
        return True
