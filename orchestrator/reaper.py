"""Sessions whose caches nobody would release soon: those an orchestrator that died left
running, and those of cut answers kept for a retry that has not come.

A session that no later call can name (not kept, no request id) is released by the call
that runs it, at its end. If that call's orchestrator dies (a crash, an OOM kill, a node
lost), nobody releases it: its handle stayed in Redis until `--session-ttl` (600 s) and its
caches on both replicas until their idle expiry, holding memory a replica's live sessions
need. Now every orchestrator keeps a heartbeat key in Redis (renewed every `BEAT_S`, expiring
after `ALIVE_S`), lists each such session beside its own id while it runs
(`session_store.EPHEMERAL`), and every `interval` seconds releases the listed sessions of
orchestrators whose heartbeat is gone: caches on both replicas and the handle, as the dead
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

log = logging.getLogger(__name__)
ALIVE_PREFIX = "specdec:orchestrator:"
BEAT_S = 1.0  # how often an orchestrator renews its heartbeat
ALIVE_S = 5  # how long a heartbeat lasts unrenewed: an orchestrator silent this long is dead
INTERVAL_S = 2.0  # how often the listed sessions are checked
MAX_PER_PASS = 64  # sessions released per check at most, so that one pass stays short


class Reaper:
    """One orchestrator's heartbeat, and its share of releasing the dead ones' sessions."""

    def __init__(self, generator, redis, orchestrator_id: str, interval: float = INTERVAL_S) -> None:
        self.generator = generator  # releases a session as a call's end does (Generator.release)
        self.store = generator.store
        self.redis = redis
        self.id = orchestrator_id
        self.interval = interval  # 0: no reaping (the heartbeat still beats)
        self._task: asyncio.Task | None = None

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:16]

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop beating and say so at once: this orchestrator's sessions left over (a drain
        cut short) are released by the others without waiting for the heartbeat to lapse."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.redis.delete(ALIVE_PREFIX + self.id)
        except RedisError:
            pass

    async def _run(self) -> None:
        checked = 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.redis.set(ALIVE_PREFIX + self.id, "1", ex=ALIVE_S)
                if self.interval and loop.time() - checked >= self.interval:
                    checked = loop.time()
                    await self.reap_once()
            except (RedisError, SpecDecError) as exc:
                log.warning("session reaper: %s", exc)
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any failure of a pass
                log.exception("session reaper: a pass failed")
            await asyncio.sleep(BEAT_S)

    async def reap_once(self) -> int:
        """Release the listed sessions of dead orchestrators whose lease has run out → how many."""
        reaped = 0
        for session_id in await self.store.parked_due(MAX_PER_PASS):
            reaped += await self._unpark(session_id)
        listed = await self.store.ephemeral_sessions()
        owners = sorted(set(listed.values()) - {self.id})
        if not owners:
            return reaped
        async with self.redis.pipeline(transaction=False) as pipe:
            for owner in owners:
                pipe.exists(ALIVE_PREFIX + owner)
            alive = dict(zip(owners, await pipe.execute()))
        dead = [sid for sid, owner in listed.items() if owner != self.id and not alive[owner]]
        for session_id in dead[:MAX_PER_PASS]:
            reaped += await self._reap(session_id, listed[session_id])
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
