"""Session handles in Redis: the orchestrator's only memory of a session.

A handle records which draft and target replica hold the session's KV caches, the
committed token ids, what each cache holds (the cursor), an epoch and the sampling
parameters; it expires after a TTL refreshed on use. A round's commit is one atomic
server-side script (append the new tokens, update the cursor, refresh the TTLs), so any
orchestrator can continue the session from the last completed round.

One call at a time holds a session: a lock in Redis whose owner is the call, held as a
lease. Every round's commit renews it in the same script, so a generation keeps its
session however long it runs, and one whose orchestrator died frees it within the lease
rather than for minutes. The commit is also fenced by it: a call whose lease lapsed and
whose session another call took meanwhile is refused (SessionBusy) instead of writing its
tokens over the other's, and a commit never brings back a handle that is gone (ended, or
lost by Redis): it says so and the call writes the whole handle again.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from specdec import metrics
from specdec.commit_batch import CommitBatcher
from specdec.errors import SessionBusy, SessionNotFound, Unavailable
from specdec.retry import RetryWindow
from specdec.rounds import Cursor

PREFIX = "specdec:session:"
# the sessions no later call can name (no session_id kept, no request id), each with the
# orchestrator running it: what orchestrator/reaper.py releases once that one has died
EPHEMERAL = "specdec:ephemeral"
# the sessions of cut answers to requests with ids, not kept: each with when its retry window
# ends, after which orchestrator/reaper.py releases its caches (its handle stays for a retry)
PARKED = "specdec:parked"
LEASE_SECONDS = 30.0  # how long a call holds its session without a round's commit

# A round's commit: what a MULTI/EXEC of SETRANGE, HSET and two EXPIREs did, as one
# command with one reply. redis-py's pipeline built and parsed six commands' worth of
# replies for it: 250-270 µs of the orchestrator's CPU a round against 113-121 µs for this
# script (1,000 commits each against a local redis-server, 2026-12-01). Scripts run
# atomically, like the transaction. First the lease: held by this call, or by none, and
# the handle still there, it is renewed; else nothing is written: 0 = another call holds
# the session, -1 = the handle is gone (SETRANGE would bring it back as zero bytes up to
# the offset). KEYS: meta, tokens, lock, and where the round has them, the log-probabilities
# of its request's answer (AnswerScores); ARGV: byte offset, token bytes, TTL, owner, lease
# in ms, the log-probabilities' byte offset and bytes (unused without the fourth key), then
# the handle's fields and values.
COMMIT_SCRIPT = """
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[4] then return 0 end
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
redis.call('SETRANGE', KEYS[2], tonumber(ARGV[1]), ARGV[2])
if KEYS[4] then
  redis.call('SETRANGE', KEYS[4], tonumber(ARGV[6]), ARGV[7])
  redis.call('EXPIRE', KEYS[4], ARGV[3])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""
COMMITTED, TAKEN, GONE = 1, 0, -1  # the commit script's replies
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
    owner: str = ""  # the call holding the session's lease (not stored in the handle)
    # the requests with ids this session served, as the orchestrator records them
    # (orchestrator/request_ids.py): written with the whole handle, never by a round's commit
    requests: list = field(default_factory=list)
    # a seeded request's γ policy after its last committed round, as the orchestrator
    # snapshots it for a retry to go on from (empty: none); written by every round's commit
    policy: str = ""
    # no later call can name it (not kept, no request id): listed under EPHEMERAL with the
    # orchestrator running it while it lives (not stored in the handle)
    ephemeral: bool = False

    @property
    def length(self) -> int:
        return len(self.committed)

    @property
    def answer_starts(self) -> list[int]:
        """Where each recorded request's answer starts (a record's third entry,
        orchestrator/request_ids.RequestMark): what names its stored log-probabilities."""
        return [int(item[2]) for item in self.requests]


def _tokens_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


def _meta(handle: SessionHandle) -> dict:
    meta = {"draft": handle.draft_replica, "target": handle.target_replica, "epoch": handle.epoch,
            "length": handle.length, "draft_len": handle.cursor.draft_len,
            "target_len": handle.cursor.target_len, "target_resync": int(handle.cursor.target_resync),
            "params": json.dumps(handle.params)}
    if handle.policy:
        meta["policy"] = handle.policy
    return meta


@dataclass(frozen=True)
class AnswerScores:
    """A round's log-probabilities (specdec/logprob_records.py `pack`) for a request with an id that
    asked for them, committed with its tokens in the same script, so that a retry finds both
    or neither and sends them again. One key per request, named by where its answer starts;
    it expires with the session's TTL, renewed by that request's rounds and by every write
    of the whole handle (a later request on the session), and goes with the handle."""
    answer_start: int
    offset: int  # of this round's records, in bytes
    data: bytes


@dataclass(frozen=True)
class RoundCommit:
    """A round's commit script call, its keys and arguments fixed when it was taken."""
    keys: list[str]
    args: list


class SessionStore:
    def __init__(self, client: aioredis.Redis, ttl_seconds: int = 600, commit_retry_seconds: float = 5.0,
                 lease_seconds: float = LEASE_SECONDS, orchestrator_id: str = "") -> None:
        self.redis = client
        self.orchestrator_id = orchestrator_id  # whose ephemeral sessions this store's writes list
        self.ttl = ttl_seconds
        self.lease_ms = max(1, round(lease_seconds * 1000))
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

    @staticmethod
    def _lock_key(session_id: str) -> str:
        return PREFIX + session_id + ":lock"

    async def create(self, handle: SessionHandle, ttl: int | None = None) -> None:
        """Write the whole handle (and, where it has an owner, renew that owner's lease),
        to expire after `ttl` seconds (default: the store's)."""
        meta, toks = self._keys(handle.session_id)
        ttl = self.ttl if ttl is None else ttl
        fields = _meta(handle)
        if handle.requests:
            fields["requests"] = json.dumps(handle.requests)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(meta, toks)
                pipe.hset(meta, mapping=fields)
                pipe.set(toks, _tokens_bytes(handle.committed))
                pipe.expire(meta, ttl)
                pipe.expire(toks, ttl)
                for start in handle.answer_starts:  # its requests' log-probabilities live as long
                    for key in self.scores_keys(handle.session_id, start):
                        pipe.expire(key, ttl)
                if handle.owner:
                    pipe.set(self._lock_key(handle.session_id), handle.owner, px=self.lease_ms)
                if handle.ephemeral and self.orchestrator_id:
                    pipe.hset(EPHEMERAL, handle.session_id, self.orchestrator_id)
                await pipe.execute()
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def load(self, session_id: str) -> SessionHandle:
        """A session's handle as last committed. It takes no lease: `acquire` and the
        reaper take one first, so that the handle they read is not one a call is changing."""
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
                             cursor, json.loads(meta["params"]), requests=json.loads(meta.get("requests", "[]")),
                             policy=meta.get("policy", ""))

    def scores_key(self, session_id: str, answer_start: int, prompt: bool = False) -> str:
        """The key of the log-probabilities of a request's answer, or of its prompt."""
        return f"{PREFIX}{session_id}:{'prompt_logprobs' if prompt else 'logprobs'}:{answer_start}"

    def scores_keys(self, session_id: str, answer_start: int) -> tuple[str, str]:
        return self.scores_key(session_id, answer_start), self.scores_key(session_id, answer_start, prompt=True)

    async def load_scores(self, session_id: str, answer_start: int, prompt: bool = False) -> bytes:
        """The log-probabilities stored for the request whose answer starts there, of its
        answer or of its prompt (b"": none)."""
        try:
            return await self.redis.get(self.scores_key(session_id, answer_start, prompt)) or b""
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def save_prompt_scores(self, session_id: str, answer_start: int, data: bytes) -> None:
        """A request's prompt's log-probabilities, written before its first round's commit,
        so that a retry finds them wherever it finds any of its answer: the retry does not
        feed its prompt again. They live as the handle's others do. Retried like a commit,
        for the commit it goes before."""
        key = self.scores_key(session_id, answer_start, prompt=True)
        await self._retrying(lambda: self.redis.set(key, data, ex=self.ttl))

    def round_commit(self, handle: SessionHandle, new_tokens: list[int],
                     scores: AnswerScores | None = None) -> RoundCommit:
        """A round's commit as the handle stands *now*: the round's tokens and what the caches
        hold after it. Taken as the round ends, because the commit itself runs later, beside
        the next round's calls, and that round may already have changed the handle by then
        (its tokens appended: an offset computed then would write this round's tokens past
        their place). `handle.committed` already includes new_tokens. Every write is
        absolute (SETRANGE at an offset, the whole cursor), so a commit may be retried."""
        offset = 4 * (handle.length - len(new_tokens))
        args = [offset, _tokens_bytes(new_tokens), self.ttl, handle.owner, self.lease_ms,
                scores.offset if scores else 0, scores.data if scores else b""]
        for field_value in _meta(handle).items():
            args.extend(field_value)
        keys = [*self._keys(handle.session_id), self._lock_key(handle.session_id)]
        if scores is not None:
            keys.append(self.scores_key(handle.session_id, scores.answer_start))
        return RoundCommit(keys, args)

    async def commit(self, commit: RoundCommit) -> bool:
        """One atomic script (the stored length guards readers against a partially applied
        append anyway), sent in one write with the other sessions' commits of this loop
        turn (specdec/commit_batch.py). While Redis restarts the stream waits, with
        backoff, up to commit_retry_seconds. → False where the handle is gone and nothing
        was written (the caller writes it whole again, `create`); SessionBusy where another
        call took the session over."""
        reply = await self._commits.submit(commit.keys, commit.args)
        if reply == TAKEN:
            metrics.SESSION_CONFLICTS.labels("taken_over").inc()
            session_id = commit.keys[0][len(PREFIX):]
            raise SessionBusy(f"session {session_id} was taken over by another call while this one went "
                              f"{self.lease_ms / 1000:g} s or more without a round (the session lease); "
                              "the tokens streamed so far are committed")
        return reply == COMMITTED

    async def _retrying(self, call: Callable[[], Awaitable]):
        """`call()`'s answer, called again with backoff while Redis is unreachable, for up to
        commit_retry_seconds (then Unavailable): every write retried so may run twice."""
        window = RetryWindow(self.commit_retry_seconds)
        while True:
            try:
                return await call()
            except RedisError as exc:
                if window.spent():
                    raise Unavailable(f"Redis is unavailable: {exc}") from exc
                await window.wait()

    async def save(self, handle: SessionHandle, ttl: int | None = None) -> None:
        """Rewrite a whole handle (after a prompt is appended or the session is re-homed)."""
        await self.create(handle, ttl)

    async def delete(self, session_id: str, answer_starts: list[int] = ()) -> bool:
        """Delete the handle, its lock, and the log-probabilities stored for its requests.
        Retried like a commit: a call that ended as Redis restarted left its handle until
        the TTL, minutes later (the e2e Redis restart found one). Every write here is
        absolute, so it may run twice."""
        scores = [key for start in answer_starts for key in self.scores_keys(session_id, start)]

        async def once() -> bool:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(*self._keys(session_id), self._lock_key(session_id), *scores)
                pipe.hdel(EPHEMERAL, session_id)
                pipe.zrem(PARKED, session_id)
                deleted, _, _ = await pipe.execute()
            return bool(deleted)

        return await self._retrying(once)

    async def try_lock(self, session_id: str, owner: str) -> bool:
        """One generation at a time per session: a second concurrent call is refused. The
        lock is a lease, renewed by each of the owner's commits."""
        try:
            return bool(await self.redis.set(self._lock_key(session_id), owner, nx=True, px=self.lease_ms))
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def acquire(self, session_id: str, owner: str, create: bool = False) -> SessionHandle | None:
        """The session's handle, held by `owner`: SessionBusy while another call holds it,
        SessionNotFound where there is none (or, with `create`, None with the lock kept, for
        the caller to create it). Locked before it is read, so that the handle read is the
        one the last call left, not one a call still running will change."""
        if not await self.try_lock(session_id, owner):
            metrics.SESSION_CONFLICTS.labels("in_use").inc()
            try:
                left = max(0.0, await self.redis.pttl(self._lock_key(session_id)) / 1000)
            except RedisError:
                left = self.lease_ms / 1000
            raise SessionBusy(f"session {session_id} is in use by another call; retry once it ends (if the "
                              f"orchestrator running it stopped, the session is free within {left:.0f} s)")
        try:
            handle = await self.load(session_id)
        except SessionNotFound:
            if create:
                return None
            await self.unlock(session_id, owner)
            raise
        except BaseException:
            await self.unlock(session_id, owner)
            raise
        handle.owner = owner
        return handle

    async def unlock(self, session_id: str, owner: str) -> None:
        """Release the lock if this owner still holds it. Retried like a commit: a lock left
        behind by a Redis blip at the end of a call would refuse the session's next call
        (RESOURCE_EXHAUSTED) until it expired, minutes later. Where Redis stays away past
        the retries it expires by itself."""
        try:
            await self._retrying(lambda: self._unlock_script(keys=[self._lock_key(session_id)], args=[owner]))
        except Unavailable:
            pass

    async def ephemeral_sessions(self) -> dict[str, str]:
        """Every listed ephemeral session → the orchestrator running it."""
        try:
            listed = await self.redis.hgetall(EPHEMERAL)
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc
        return {k.decode(): v.decode() for k, v in listed.items()}

    async def forget_ephemeral(self, session_id: str) -> None:
        try:
            await self.redis.hdel(EPHEMERAL, session_id)
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def park(self, session_id: str, seconds: float) -> None:
        """List a cut answer's session, to have its caches released `seconds` from now."""
        try:
            await self.redis.zadd(PARKED, {session_id: time.time() + seconds})
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def parked_due(self, limit: int) -> list[str]:
        """Parked sessions whose time has come, the longest due first."""
        try:
            due = await self.redis.zrangebyscore(PARKED, "-inf", time.time(), start=0, num=limit)
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc
        return [sid.decode() for sid in due]

    async def unpark(self, session_id: str) -> None:
        try:
            await self.redis.zrem(PARKED, session_id)
        except RedisError as exc:
            raise Unavailable(f"Redis is unavailable: {exc}") from exc

    async def session_ids(self) -> list[str]:
        ids = []
        async for key in self.redis.scan_iter(match=PREFIX + "*", count=500):
            k = key.decode()[len(PREFIX):]
            if ":" not in k:
                ids.append(k)
        return ids
