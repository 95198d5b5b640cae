"""The per-replica table of session KV caches: epochs, expected lengths, LRU eviction,
idle expiry.

Every call names (session, epoch, start): the cache must hold exactly `start` positions
(target), or at least that many (draft, whose cache runs ahead by design), before the
call's tokens are fed. Anything else is refused, so a stale or duplicated call can never
advance a cache twice; the caller re-syncs with `resync` or rebuilds from start 0.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from specdec.errors import CacheMismatch, InvalidRequest, Overloaded
from specdec.kv_cache import KVCache
from specdec.model_runner import ModelRunner


@dataclass
class CacheRef:
    session_id: str
    epoch: int
    start: int
    tokens: list[int]
    resync: bool = False


@dataclass
class Session:
    cache: KVCache
    epoch: int
    last_used: float = field(default_factory=time.monotonic)


class SessionTable:
    def __init__(self, runner: ModelRunner, max_sessions: int = 256, max_cache_bytes: int = 0) -> None:
        self.runner = runner
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes  # 0 = unbounded
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.evictions = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def cache_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values())

    def validate(self, ref: CacheRef, extra: int = 0) -> None:
        if not ref.session_id or len(ref.session_id) > 128:
            raise InvalidRequest("session_id must be 1..128 characters")
        if ref.start < 0:
            raise InvalidRequest(f"start must be >= 0, got {ref.start}")
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in ref.tokens):
            raise InvalidRequest(f"token ids must lie in 0..{vocab - 1}")
        end = ref.start + len(ref.tokens) + extra
        if end > self.runner.max_length:
            raise InvalidRequest(f"{end} positions exceed the model context of {self.runner.max_length}")

    def acquire(self, ref: CacheRef, exact: bool, busy: set[str] = frozenset()) -> tuple[KVCache, bool]:
        """The cache for this call, rolled back to `start`; returns (cache, resynced)."""
        sess = self._sessions.get(ref.session_id)
        if sess is not None and ref.epoch < sess.epoch:
            raise CacheMismatch(f"session {ref.session_id}: epoch {ref.epoch} is stale (the replica holds "
                                f"epoch {sess.epoch})")
        if sess is None or ref.epoch > sess.epoch:
            if ref.start != 0:
                raise CacheMismatch(f"session {ref.session_id} (epoch {ref.epoch}) is not held by this "
                                    "replica (evicted, expired or never created); rebuild from start 0")
            return self._create(ref, busy).cache, sess is not None
        sess.last_used = time.monotonic()
        self._sessions.move_to_end(ref.session_id)
        length = sess.cache.length
        if ref.start == length:
            return sess.cache, False
        if ref.start < length and (ref.resync or not exact):
            sess.cache.truncate(ref.start)
            return sess.cache, exact
        raise CacheMismatch(f"session {ref.session_id}: the replica holds {length} positions but the call "
                            f"expects {ref.start} (stale, duplicated or retried call)")

    def fork(self, ref: CacheRef, extra: int) -> KVCache:
        """A private copy of the session's first `start` positions, with room for `extra`
        more: a pre-draft of a branch the round has not taken yet writes there, so the
        session's cache keeps the line the orchestrator's cursor knows. Not in the table:
        it lives for one call. The copy is of the KV rows only, which for any model cost
        less to copy than one step streams in weights."""
        sess = self._sessions.get(ref.session_id)
        if sess is None or sess.epoch != ref.epoch or sess.cache.length < ref.start:
            raise CacheMismatch(f"session {ref.session_id}: no cache of epoch {ref.epoch} holding "
                                f"{ref.start} positions to fork from")
        return sess.cache.fork(ref.start, ref.start + len(ref.tokens) + extra)

    def _create(self, ref: CacheRef, busy: set[str]) -> Session:
        self._sessions.pop(ref.session_id, None)
        self._evict_for(1, busy | {ref.session_id})
        sess = Session(cache=self.runner.new_cache(), epoch=ref.epoch)
        self._sessions[ref.session_id] = sess
        return sess

    def _evict_for(self, new_sessions: int, busy: set[str]) -> None:
        """Evict least-recently-used idle sessions until the new ones fit."""
        def over() -> bool:
            if len(self._sessions) + new_sessions > self.max_sessions:
                return True
            return bool(self.max_cache_bytes) and self.cache_bytes > self.max_cache_bytes
        while over():
            victim = next((sid for sid in self._sessions if sid not in busy), None)
            if victim is None:
                raise Overloaded(f"replica is full: {len(self._sessions)} sessions in use "
                                 f"(max {self.max_sessions}); retry later or add replicas")
            del self._sessions[victim]
            self.evictions += 1

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def expire_idle(self, max_idle: float, now: float | None = None) -> int:
        """Release the sessions idle for longer than `max_idle` seconds; → how many. The
        table is in order of last use, so this looks at the expired ones and one more. An
        orchestrator that dies, or a Release that is lost, leaves a cache no call will use
        again: until evicted for room it would hold memory and count in the replica's load,
        which routing and autoscaling read."""
        now = time.monotonic() if now is None else now
        n = 0
        while self._sessions:
            sid, sess = next(iter(self._sessions.items()))
            if now - sess.last_used <= max_idle:
                break
            del self._sessions[sid]
            n += 1
        self.expired += n
        return n

    def length(self, session_id: str) -> int | None:
        sess = self._sessions.get(session_id)
        return None if sess is None else sess.cache.length
