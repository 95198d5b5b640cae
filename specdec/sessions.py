"""The per-replica table of session KV caches: epochs, expected lengths, LRU eviction,
idle expiry.

Every call names (session, epoch, start): the cache must hold exactly `start` positions
(target), or at least that many (draft, whose cache runs ahead by design), before the
call's tokens are fed. Anything else is refused, so a stale or duplicated call can never
advance a cache twice; the caller re-syncs with `resync` or rebuilds from start 0.

A new session whose first tokens another held cache already holds (a shared system prompt,
the same prompt asked again, several answers to one prompt) starts from a copy of that
cache's positions instead of computing them again (`reuse_prefixes`): the table finds the
held cache with the longest common prefix among those that began with the same
`MIN_SHARED` tokens (live sessions, and the last `MAX_RETIRED` released ones, which are kept
for this only, in place of older ones they mostly repeat, and go first when room is needed),
copies its keys, values and ids up to that prefix (never the call's last token, whose
logits the call needs), and the engine feeds the rest. Each position's keys and values
depend only on the tokens up to it, so the copy is what a prefill would compute, up to the
float rounding of a forward over other rows. Paged caches (specdec.paged_cache) share the
donor's whole blocks instead, copying only its last partial one and any shared block
before it is written.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from specdec.cache_ref import CacheRef
from specdec.errors import CacheMismatch, InvalidRequest, Overloaded
from specdec.kv_cache import KVCache
from specdec.model_runner import ModelRunner


MIN_SHARED = 16  # a shorter common prefix is computed again: its copy would save too little
MAX_RETIRED = 8  # released caches kept as donors of prefixes only (the first evicted for room)


@dataclass
class Session:
    cache: KVCache
    epoch: int
    last_used: float = field(default_factory=time.monotonic)
    head: bytes | None = None  # its first MIN_SHARED token ids, where it was indexed by them


class SessionTable:
    def __init__(self, runner: ModelRunner, max_sessions: int = 256, max_cache_bytes: int = 0,
                 reuse_prefixes: bool = True) -> None:
        self.runner = runner
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes  # 0 = unbounded
        self.reuse_prefixes = reuse_prefixes
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_head: dict[bytes, set[str]] = {}  # first MIN_SHARED ids → sessions that began with them
        self._retired: OrderedDict[int, tuple[bytes, KVCache, float]] = OrderedDict()  # released donors
        self._retired_count = 0
        self.evictions = 0
        self.expired = 0
        self.prefix_reuses = 0  # new sessions started from another cache's copy
        self.reused_positions = 0  # positions those copies saved computing

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the sessions' caches and the released ones kept as prefix donors
        (paged: the pool's blocks in use, which are theirs and a call's forks in flight; the
        same total as their shares, counted without a pass over every cache's blocks, which
        each batch's budget check would pay)."""
        pool = self.runner.pool
        if pool is not None:
            return pool.used * pool.block_bytes
        return (sum(s.cache.nbytes for s in self._sessions.values())
                + sum(cache.nbytes for _, cache, _ in self._retired.values()))

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

    def acquire(self, ref: CacheRef, exact: bool, busy: set[str] = frozenset(),
                reuse: bool = True) -> tuple[KVCache, bool]:
        """The cache for this call, rolled back to `start`; returns (cache, resynced). A new
        session's cache may already hold a prefix of the call's tokens, copied from another
        (`reuse`, where the table reuses prefixes): the caller feeds only the tokens from
        its `length` on, which is `start` for any other call."""
        sess = self._sessions.get(ref.session_id)
        if sess is not None and ref.epoch < sess.epoch:
            raise CacheMismatch(f"session {ref.session_id}: epoch {ref.epoch} is stale (the replica holds "
                                f"epoch {sess.epoch})")
        if sess is None or ref.epoch > sess.epoch:
            if ref.start != 0:
                raise CacheMismatch(f"session {ref.session_id} (epoch {ref.epoch}) is not held by this "
                                    "replica (evicted, expired or never created); rebuild from start 0")
            return self._create(ref, busy, reuse and self.reuse_prefixes).cache, sess is not None
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

    def _create(self, ref: CacheRef, busy: set[str], reuse: bool) -> Session:
        older = self._drop(ref.session_id)  # an older epoch's cache: a donor like any released one
        if older is not None:
            self._retire(older)
        self._evict_for(1, busy | {ref.session_id})
        head = _head(ref.tokens)
        cache = self._copied_prefix(ref.tokens, head) if reuse and head is not None else None
        sess = Session(cache=self.runner.new_cache() if cache is None else cache, epoch=ref.epoch, head=head)
        self._sessions[ref.session_id] = sess
        if head is not None:
            self._by_head.setdefault(head, set()).add(ref.session_id)
        return sess

    def _copied_prefix(self, tokens: list[int], head: bytes) -> KVCache | None:
        """A new cache holding the longest prefix of `tokens` but the last that a held cache
        begun with the same head holds (at least MIN_SHARED positions), or None."""
        want = np.asarray(tokens[:-1], dtype=np.int64)
        best, shared = None, MIN_SHARED - 1
        # snapshots (a Release runs on the event loop while a batch runs on the engine thread)
        live = (self._sessions.get(sid) for sid in tuple(self._by_head.get(head, ())))
        donors = [sess.cache for sess in live if sess is not None]
        donors += [cache for key, cache, _ in tuple(self._retired.values()) if key == head]
        for cache in donors:
            if min(cache.length, len(want)) <= shared:
                continue
            common = _common_prefix(cache.ids[:cache.length], want)
            if common > shared:
                best, shared = cache, common
        if best is None:
            return None
        self.prefix_reuses += 1
        self.reused_positions += shared
        return best.fork(shared, len(tokens))

    def _drop(self, session_id: str) -> Session | None:
        sess = self._sessions.pop(session_id, None)
        if sess is not None and sess.head is not None:
            sessions = self._by_head.get(sess.head)
            if sessions is not None:
                sessions.discard(session_id)
                if not sessions:
                    del self._by_head[sess.head]
        return sess

    def make_room(self, needs: list[tuple[KVCache, int]], busy: set[str]) -> None:
        """Before a batch writes: room under `max_cache_bytes` for its caches to grow to the
        lengths they need, by evicting released donors, then the least recently used idle
        sessions. Caches grow as their sessions decode (`KVCache.reserve`), which the check
        at a session's creation alone never saw: live sessions grew past the budget while
        idle ones stayed held (on a GPU, into an out-of-memory error that fails a whole
        batch). Where only the batch's own sessions are left, the batch grows past the budget
        rather than fail sessions mid-answer; the next new session is then refused."""
        if not self.max_cache_bytes:
            return
        extra = sum(cache.growth_bytes(length) for cache, length in needs)
        if extra:
            self._evict_for(0, busy, extra, refuse=False)

    def _evict_for(self, new_sessions: int, busy: set[str], extra_bytes: int = 0, refuse: bool = True) -> None:
        """Evict least-recently-used idle sessions until the new ones (and `extra_bytes`)
        fit; where no idle one is left, refuse (RESOURCE_EXHAUSTED) or, without `refuse`,
        leave it."""
        while True:
            count_over = len(self._sessions) + new_sessions > self.max_sessions
            bytes_over = bool(self.max_cache_bytes) and self.cache_bytes + extra_bytes > self.max_cache_bytes
            if not (count_over or bytes_over):
                return
            if bytes_over and self._retired:  # released donors go first
                self._retired.popitem(last=False)
                continue
            victim = next((sid for sid in self._sessions if sid not in busy), None)
            if victim is None:
                if not refuse:
                    return
                if count_over:
                    raise Overloaded(f"replica is full: {len(self._sessions)} sessions in use "
                                     f"(max {self.max_sessions}); retry later or add replicas")
                raise Overloaded(f"replica is full: its {len(self._sessions)} sessions' KV caches hold "
                                 f"{self.cache_bytes / 2**20:.0f} MiB (max {self.max_cache_bytes / 2**20:.0f}) "
                                 "and all are in use; retry later or add replicas")
            self._drop(victim)
            self.evictions += 1

    def release(self, session_id: str) -> bool:
        sess = self._drop(session_id)
        if sess is None:
            return False
        self._retire(sess)
        return True

    def _retire(self, sess: Session) -> None:
        """Keep a released cache as a donor of prefixes (the last MAX_RETIRED of them), in
        place of the older donors it mostly repeats: those sharing at least half their
        positions with it (`_repeats`), whose prefixes it supplies as far as that. Under a
        soak's mix, donors of prompts alike in their first thousand tokens held 217 of a
        target's 276 MiB of caches (2026-12-07); a system prompt's sessions are alike so."""
        if self.reuse_prefixes and sess.head is not None and sess.cache.length >= MIN_SHARED:
            # a snapshot: a Release runs on the event loop, a new session's epoch on the engine thread
            for key, (head, cache, _) in tuple(self._retired.items()):
                if head == sess.head and _repeats(sess.cache, cache):
                    self._retired.pop(key, None)
            self._retired[self._retired_count] = (sess.head, sess.cache, time.monotonic())
            self._retired_count += 1
            while len(self._retired) > MAX_RETIRED:
                self._retired.popitem(last=False)

    def expire_idle(self, max_idle: float, now: float | None = None) -> int:
        """Release the sessions idle for longer than `max_idle` seconds; → how many. The
        table is in order of last use, so this looks at the expired ones and one more. An
        orchestrator that dies, or a Release that is lost, leaves a cache no call will use
        again: until evicted for room it would hold memory and count in the replica's load,
        which routing and autoscaling read."""
        now = time.monotonic() if now is None else now
        while self._retired and now - next(iter(self._retired.values()))[2] > max_idle:
            self._retired.popitem(last=False)
        n = 0
        while self._sessions:
            sid, sess = next(iter(self._sessions.items()))
            if now - sess.last_used <= max_idle:
                break
            self._drop(sid)
            n += 1
        self.expired += n
        return n

    def length(self, session_id: str) -> int | None:
        sess = self._sessions.get(session_id)
        return None if sess is None else sess.cache.length


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids the two arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _repeats(newer: KVCache, older: KVCache) -> bool:
    """Whether `newer` holds at least half of `older`'s positions (a common prefix)."""
    return 2 * _common_prefix(newer.ids[:newer.length], older.ids[:older.length]) >= older.length


def _head(tokens: list[int]) -> bytes | None:
    """The key a prompt is indexed by for prefix reuse: its first MIN_SHARED ids, where it
    has more than that (one more at least, the token a call always feeds)."""
    if len(tokens) <= MIN_SHARED:
        return None
    return np.asarray(tokens[:MIN_SHARED], dtype=np.int64).tobytes()
