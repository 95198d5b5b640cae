"""Session handles in Redis: the orchestrator's only memory of a session.

A handle records which draft and target replica hold the session's KV caches, the
committed token ids, what each cache holds (the cursor), an epoch and the sampling
parameters; it expires after a TTL refreshed on use. A round's commit is one atomic
server-side script (append the new tokens, update the cursor, refresh the TTLs), so any
orchestrator can continue the session from the last completed round.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from specdec.commit_batch import CommitBatcher
from specdec.errors import SessionNotFound, Unavailable
from specdec.retry import RetryWindow
from specdec.rounds import Cursor

PREFIX = "specdec:session:"

# A round's commit: what a MULTI/EXEC of SETRANGE, HSET and two EXPIREs did, as one
# command with one reply. redis-py's pipeline built and parsed six commands' worth of
# replies for it: 250-270 µs of the orchestrator's CPU a round against 113-121 µs for this
# script (1,000 commits each against a local redis-server, 2026-12-01). Scripts run
# atomically, like the transaction. KEYS: meta, tokens; ARGV: byte offset, token bytes,
# TTL, then the handle's fields and values.
COMMIT_SCRIPT = """
redis.call('SETRANGE', KEYS[2], tonumber(ARGV[1]), ARGV[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""
# A session's lock released by its owner only, in one step: a GET then a DEL could delete a
# lock another call took after this one's expired. KEYS: the lock; ARGV: the owner.
UNLOCK_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class SessionHandle:
    session_id: str
    draft_replica: str
    target_replica: str
    epoch: int
    committed: list[int]
    cursor: Cursor = field(default_factory=Cursor)
    params: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.committed)


def _tokens_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


def _meta(handle: SessionHandle) -> dict:
    return {"draft": handle.draft_replica, "target": handle.target_replica, "epoch": handle.epoch,
            "length": handle.length, "draft_len": handle.cursor.draft_len,
            "target_len": handle.cursor.target_len, "target_resync": int(handle.cursor.target_resync),
            "params": json.dumps(handle.params)}


@dataclass(frozen=True)
class RoundCommit:
    """A round's commit script call, its keys and arguments fixed when it was taken."""
    keys: list[str]
    args: list


class SessionStore:
    def __init__(self, client: aioredis.Redis, ttl_seconds: int = 600, commit_retry_seconds: float = 5.0) -> None:
        self.redis = client
        self.ttl = ttl_seconds
        self.commit_retry_seconds = commit_retry_seconds  # rides out a Redis restart mid-stream
        # EVALSHA, loading the script again after a Redis restart forgot it (NOSCRIPT); the
        # commit script's batcher does the same for its own
        self._unlock_script = client.register_script(UNLOCK_SCRIPT)
        self._commits = CommitBatcher(client, COMMIT_SCRIPT, commit_retry_seconds)

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def _keys(self, session_id: str) -> tuple[str, str]:
        return PREFIX + session_id, PREFIX + session_id + ":tokens"

    async def create(self, handle: SessionHandle) -> None:
        meta, toks = self._keys(handle.session_id)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(meta, toks)
                pipe.hset(meta, mapping=_meta(handle))
                pipe.set(toks, _tokens_bytes(handle.committed))
                pipe.expire(meta, self.ttl)
                pipe.expire(toks, self.ttl)
                await pipe.execute()
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def load(self, session_id: str) -> SessionHandle:
        meta_key, toks_key = self._keys(session_id)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(meta_key)
                pipe.get(toks_key)
                meta, toks = await pipe.execute()
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc
        if not meta or toks is None:
            raise SessionNotFound(f"session {session_id!r} does not exist or has expired")
        meta = {k.decode(): v.decode() for k, v in meta.items()}
        length = int(meta["length"])
        committed = np.frombuffer(toks, dtype=np.int32)[:length].tolist()
        cursor = Cursor(int(meta["draft_len"]), int(meta["target_len"]), bool(int(meta["target_resync"])))
        return SessionHandle(session_id, meta["draft"], meta["target"], int(meta["epoch"]), committed,
                             cursor, json.loads(meta["params"]))

    def round_commit(self, handle: SessionHandle, new_tokens: list[int]) -> RoundCommit:
        """A round's commit as the handle stands *now*: the round's tokens and what the caches
        hold after it. Taken as the round ends, because the commit itself runs later, beside
        the next round's calls, and that round may already have changed the handle by then
        (its tokens appended: an offset computed then would write this round's tokens past
        their place). `handle.committed` already includes new_tokens. Every write is
        absolute (SETRANGE at an offset, the whole cursor), so a commit may be retried."""
        offset = 4 * (handle.length - len(new_tokens))
        args = [offset, _tokens_bytes(new_tokens), self.ttl]
        for field_value in _meta(handle).items():
            args.extend(field_value)
        return RoundCommit(list(self._keys(handle.session_id)), args)

    async def commit(self, commit: RoundCommit) -> None:
        """One atomic script (the stored length guards readers against a partially applied
        append anyway), sent in one write with the other sessions' commits of this loop
        turn (specdec/commit_batch.py). While Redis restarts the stream waits, with
        backoff, up to commit_retry_seconds."""
        await self._commits.submit(commit.keys, commit.args)

    async def _retrying(self, script, keys: list[str], args: list):
        """The script's answer, retried with backoff while Redis is unreachable, for up to
        commit_retry_seconds (then Unavailable): every script here may run twice."""
        window = RetryWindow(self.commit_retry_seconds)
        while True:
            try:
                return await script(keys=keys, args=args)
            except RedisError as exc:
                if window.spent():
                    raise Unavailable(f"Redis is unavailable: {exc}") from exc
                await window.wait()

    async def save(self, handle: SessionHandle) -> None:
        """Rewrite a whole handle (after a prompt is appended or the session is re-homed)."""
        await self.create(handle)

    async def delete(self, session_id: str) -> bool:
        try:
            return bool(await self.redis.delete(*self._keys(session_id), PREFIX + session_id + ":lock"))
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def try_lock(self, session_id: str, owner: str, ttl_seconds: int = 120) -> bool:
        """One generation at a time per session: a second concurrent call is refused."""
        try:
            return bool(await self.redis.set(PREFIX + session_id + ":lock", owner, nx=True, ex=ttl_seconds))
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def unlock(self, session_id: str, owner: str) -> None:
        """Release the lock if this owner still holds it. Retried like a commit: a lock left
        behind by a Redis blip at the end of a call would refuse the session's next call
        (RESOURCE_EXHAUSTED) until it expired, minutes later. Where Redis stays away past
        the retries it expires by itself."""
        try:
            await self._retrying(self._unlock_script, [PREFIX + session_id + ":lock"], [owner])
        except Unavailable:
            pass

    async def session_ids(self) -> list[str]:
        ids = []
        async for key in self.redis.scan_iter(match=PREFIX + "*", count=500):
            k = key.decode()[len(PREFIX):]
            if ":" not in k:
                ids.append(k)
        return ids
