"""The speculate → verify → correct loop across the two pools.

Per round: one draft call, one target call, one Redis commit (a single script call, sent in
one write with the other sessions' commits of the same loop turn). Replica failures
are absorbed here: a dead replica is replaced by a live one of its pool and the cache is
rebuilt from the committed tokens; with no draft replica left the loop goes on
target-only and picks speculation up again when a draft returns. A draft replica that is
there but does not answer (a pause, a hang, a queue far too long) is not waited for beyond
`draft_wait`: the round goes on target-only and the session drafts again once the replica
has answered (`Generator._in_time`). A long feed (a prompt's prefill, a cache rebuilt on
another replica) goes to a replica in chunks of `prefill_chunk` tokens, a call each, so
that no batched forward there holds the other sessions for a whole long prompt
(`Generator._feed_in_chunks`).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from orchestrator.gamma_policy import CostModel, SessionPolicy
from orchestrator.governor import LoadGovernor
from orchestrator.pools import CACHE_LOST, REPLICA_DOWN, PoolClients
from orchestrator.round_stream import SessionLinks
from orchestrator.text import TextStream
from specdec import metrics, rounds
from specdec.errors import DeadlineExceeded, InvalidRequest, Overloaded, Unavailable
from specdec.internal.v1 import replica_pb2
from specdec.sampling import SamplingParams
from specdec.session_store import RoundCommit, SessionHandle, SessionStore
from specdec.sessions import CacheRef
from specdec.spec_loop import LoopStats
from specdec.wire import drop_first_rows
from specdec.wire_pb import from_pb, to_pb

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 4
OVERLAP_MIN_HIT = 0.25  # pre-draft when the estimated hit probability is at least this
OVERLAP_MIN_USE = 0.5  # under load, only while at least this share of a kind's pre-drafts were used
# greedy, alone: at most this many branch pre-drafts beside the main one. Off by default:
# on the 2-core CPU the draft's batch of forks outlasts the verification (benchmarks/HISTORY.md, "Forks")
OVERLAP_FORKS = 0
FORK_MIN_HIT = 0.03  # a branch is forked when its chance of use is at least this
# Adaptive sessions' proposals end after a token drafted with a top probability below
# this (ProposeRequest.stop_below), per sampling kind; off by default. Priced in process
# (benchmarks.stop_rule_probe), 0.1 made greedy 1.05-1.12x the best fixed γ, but through
# the services on the 2-core CPU it lost: by turns on one stack (ab_probe, 4 rounds,
# 2026-12-01 19:28 UTC) greedy (e) made 205.7 / 343.6 / 617.9 tokens/s at 1 / 4 / 16
# streams with it against 213.0 / 389.4 / 681.6 without, since shorter proposals mean more
# rounds, and every round costs the shared cores its calls. At temperature 1 no
# threshold paid even in process. A pair whose rounds cost less may differ: measure.
STOP_BELOW_GREEDY = 0.0
STOP_BELOW_SAMPLED = 0.0
# event-loop turns a released commit waits before its Redis command: a call handed to
# MuxLink is written on the second turn after (its writer wakes, then yields one turn for
# the calls of other sessions to join the same message)
CALL_TURNS = 2
# a draft call (a proposal, or a pre-draft the next round would use) not answered within
# this many seconds is left to finish on its own and the round goes on target-only
# (`Generator._in_time`): a replica that stalls (a pause, a hang, a queue far too long)
# costs its sessions this wait once instead of the whole stall
DRAFT_WAIT_S = 0.25
# a feed longer than this many tokens (a prompt's prefill, a cache rebuilt elsewhere) goes to
# a replica as calls of this many tokens (`Generator._feed_in_chunks`): one batched forward
# over a whole long prompt holds every other session in it for as long (about 1 s for
# 2,000 tokens on the bundled target here), a chunk only for its share
PREFILL_CHUNK = 256


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    session_id: str = ""
    gamma: int | None = None  # None: adaptive
    keep_session: bool = False
    seeded: bool = False  # the client chose the seed: its output must be reproducible


@dataclass
class Stats(LoopStats):
    """The in-process loop's round counts plus what only the distributed loop has."""
    redis_ms: float = 0.0
    network_ms: float = 0.0
    failovers: int = 0
    wire_bytes: int = 0
    overlap_hits: int = 0
    started: float = 0.0  # perf_counter at the request's start
    first_token_ms: float = 0.0  # from the start until the first tokens were handed to the client (0: none yet)


@dataclass
class Outcome:
    session_id: str
    tokens: list[int]
    finish_reason: str
    stats: Stats
    prompt_tokens: int
    seed: int
    draft_replica: str
    target_replica: str
    total_ms: float


Emit = Callable[[str, list[int]], Awaitable[None]]


@dataclass
class _Generation:
    """What one run of the loop carries from round to round besides its tokens."""
    handle: SessionHandle
    deadline: float | None
    links: SessionLinks
    stats: Stats
    policy: SessionPolicy
    text: TextStream
    params_pb: replica_pb2.SamplingParams
    stop_below: float  # the confidence stop of this generation's proposals (0: off)
    prompt_len: int
    last_draft_probe: float
    runner_ups: list[int] | None = None  # the draft's runner-up at each of this round's draft positions
    # where this round's draft came from a fork: how far the draft replica's own cache still
    # holds the committed tokens (None: it holds the draft too, up to its last token)
    line: int | None = None
    speculating: bool = True  # this round's mode under load (orchestrator/governor.py)
    rounds_in_mode: int = 0  # rounds in a row in that mode, this one included
    calls: list["_Call"] = field(default_factory=list)  # this round's answered calls, for its bookkeeping
    # a draft call the loop stopped waiting for (`Generator._in_time`): until it ends the
    # session makes no other, and its rounds are target-only
    late: asyncio.Task | None = None
    closed: bool = False  # the loop has ended: a late call left running sends nothing more

    @property
    def governed(self) -> bool:
        """Whether the load governor may turn this generation's speculation off: adaptive
        γ only, and not a seeded sampled request (its policy is deterministic)."""
        return self.policy.fixed is None and not self.policy.deterministic


@dataclass(frozen=True)
class _Proposal:
    """A draft replica's answer to a proposal, with what was asked and how long it took."""
    response: replica_pb2.ProposeResponse
    ref: CacheRef  # the cache positions and tokens the call fed
    ms: float


@dataclass(frozen=True)
class _Call:
    """An answered internal call, as the round's bookkeeping (Generator._note_call) needs it."""
    pool: str  # "draft" or "target"
    ms: float  # its wall time
    request: object | None  # the message sent, where its size counts on the wire
    response: object
    steady: bool  # fed at most two tokens: a measure of a round's call (a prefill is not)
    tokens: int  # γ asked for (draft), or drafted tokens verified (target)


@dataclass(frozen=True)
class _Round:
    """What a round's bookkeeping needs (Generator._record_round), taken as the round ends."""
    gamma: int
    accepted: int
    chances: tuple[float, ...]  # the target's keep chances of a sampled draft
    tokens: int  # committed this round
    active: int  # generations in flight as it began
    speculating: bool  # its mode under load
    rounds_in_mode: int
    seconds: float  # its wall time
    calls_ms: float  # of which in its two calls
    plain: bool  # its own calls only, past the prefill: a measure of the loop's overhead
    calls: tuple[_Call, ...]


@dataclass
class _Ahead:
    """The pre-drafts running beside a round's verification: the main one (round accepted in
    full, bonus guessed) and forks by kept length j (runner-up at j + 1, its cache's base)."""
    main: asyncio.Task | None = None
    forks: dict[int, tuple[int, int, asyncio.Task]] = field(default_factory=dict)

    def tasks(self) -> list[asyncio.Task]:
        return ([self.main] if self.main else []) + [task for _, _, task in self.forks.values()]

    def cancel(self) -> None:
        for task in self.tasks():
            task.cancel()


def ref_pb(ref: CacheRef) -> replica_pb2.CacheRef:
    return replica_pb2.CacheRef(session_id=ref.session_id, epoch=ref.epoch, start=ref.start,
                                tokens=ref.tokens, resync=ref.resync)


class Generator:
    def __init__(self, pools: PoolClients, store: SessionStore, tokenizer, max_len: int,
                 costs: CostModel | None = None, call_timeout: float = 30.0, overlap: bool = True,
                 overlap_min_hit: float = OVERLAP_MIN_HIT, overlap_min_use: float = OVERLAP_MIN_USE,
                 calls: str = "mux", overlap_forks: int = OVERLAP_FORKS,
                 stop_below: tuple[float, float] = (STOP_BELOW_GREEDY, STOP_BELOW_SAMPLED),
                 governor: LoadGovernor | None = None, draft_wait: float | None = DRAFT_WAIT_S,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.pools = pools
        self.store = store
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.max_len = max_len
        self.costs = costs or CostModel()
        self.call_timeout = call_timeout
        self.overlap = overlap  # pre-draft the next round during verification (adaptive γ only)
        self.overlap_min_hit = overlap_min_hit
        self.overlap_min_use = overlap_min_use  # under load (CostModel.predraft_pays)
        self.overlap_forks = overlap_forks  # greedy branch pre-drafts while alone (_start_forks)
        self.calls = calls  # how Propose/Verify travel: round_stream.CALL_MODES
        self.stop_below = stop_below  # (greedy, sampled): the adaptive proposals' confidence stop
        self.governor = governor or LoadGovernor()  # speculation on or off under load, by measurement
        self.active = 0  # generations in flight in this process: the governor's load
        self.draft_wait = draft_wait  # seconds a draft call is waited for (None: its whole timeout)
        self.prefill_chunk = prefill_chunk  # tokens a call feeds at most before the round's own (0: no limit)
        self._background: set[asyncio.Future] = set()  # late draft calls and releases that outlive their generation
        self._stalled: dict[str, int] = {}  # draft replica → its calls late now (`_in_time`)

    # ----------------------------------------------------------------- session set-up
    async def _open(self, req: GenerationRequest, owner: str) -> SessionHandle:
        if req.session_id:
            handle = await self.store.load(req.session_id)
            if not await self.store.try_lock(req.session_id, owner):
                raise Overloaded(f"session {req.session_id} is already generating; wait for that call to finish")
            handle.committed.extend(req.prompt_ids)
        else:
            target = await self.pools.require("target")
            draft = await self.pools.pick("draft") or ""
            handle = SessionHandle(self.store.new_id(), draft, target, 1, list(req.prompt_ids))
            await self.store.try_lock(handle.session_id, owner)
        if not handle.committed:
            raise InvalidRequest("the prompt is empty: give prompt text or prompt_token_ids")
        if len(handle.committed) >= self.max_len:
            raise InvalidRequest(f"the prompt ({len(handle.committed)} tokens with the session's history) "
                                 f"leaves no room in the model context of {self.max_len} tokens")
        handle.params = {"temperature": req.params.temperature, "top_k": req.params.top_k,
                         "top_p": req.params.top_p, "seed": req.params.seed}
        await self.store.save(handle)
        return handle

    # ----------------------------------------------------------------- one call each
    def _timeout(self, deadline: float | None) -> float:
        if deadline is None:
            return self.call_timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the client's deadline passed during generation")
        return min(left, self.call_timeout)

    async def _propose(self, gen: "_Generation", gamma: int) -> "_Proposal | None":
        """→ the proposal (at most γ tokens: fewer where the confidence stop cut it), or None
        when no draft replica can serve, or the generation ended while the call was late."""
        handle, deadline = gen.handle, gen.deadline
        for _ in range(MAX_ATTEMPTS):
            if not handle.draft_replica:
                handle.draft_replica = await self.pools.pick("draft") or ""
                handle.cursor.draft_len = 0
                if not handle.draft_replica:
                    return None
            try:
                await self._feed_in_chunks(gen, "draft")
                if gen.closed:
                    return None
                ref = rounds.draft_ref(handle.session_id, handle.epoch, handle.committed, handle.cursor)
                request = replica_pb2.ProposeRequest(
                    cache=ref_pb(ref), num_tokens=gamma, sampling=gen.params_pb, stop_below=gen.stop_below,
                    runner_ups=self._forks_wanted(gen))
                t0 = time.perf_counter()
                resp = await gen.links.propose(handle.draft_replica, request, self._timeout(deadline))
            except grpc.aio.AioRpcError as exc:
                self._on_error(exc, handle, "draft", deadline, gen.stats)
                continue
            return _Proposal(resp, ref, (time.perf_counter() - t0) * 1000)
        return None

    async def _verify(self, gen: "_Generation", draft_tokens: list[int],
                      dists: replica_pb2.DraftDistributions | None) -> replica_pb2.VerifyResponse:
        handle, stats, deadline = gen.handle, gen.stats, gen.deadline
        for _ in range(MAX_ATTEMPTS):
            if not handle.target_replica:
                handle.target_replica = await self.pools.require("target")
                handle.cursor.target_len, handle.cursor.target_resync = 0, True
            try:
                await self._feed_in_chunks(gen, "target")
                ref = rounds.target_ref(handle.session_id, handle.epoch, handle.committed, handle.cursor)
                request = replica_pb2.VerifyRequest(
                    cache=ref_pb(ref), draft_tokens=draft_tokens, distributions=dists, sampling=gen.params_pb)
                t0 = time.perf_counter()
                resp = await gen.links.verify(handle.target_replica, request, self._timeout(deadline))
            except grpc.aio.AioRpcError as exc:
                self._on_error(exc, handle, "target", deadline, stats)
                continue
            ms = (time.perf_counter() - t0) * 1000
            stats.verify_ms += ms
            gen.calls.append(_Call("target", ms, request, resp, len(ref.tokens) <= 2, len(draft_tokens)))
            return resp
        raise Unavailable(f"the target pool could not verify session {handle.session_id} "
                          f"after {MAX_ATTEMPTS} attempts")

    async def _feed_in_chunks(self, gen: "_Generation", kind: str) -> None:
        """Feed a replica all but the last `prefill_chunk` tokens its cache lacks, a call of
        `prefill_chunk` tokens at a time, so that each of its batched forwards holds the
        other sessions in it for a chunk's share of a long prompt only. A chunk is a
        proposal of one token (the draft's cache runs ahead of the cursor, as after any
        proposal) or a verification without a draft (its next token is not used: the
        uniforms are counter-based, so a seeded request draws the same later on). Failures
        raise, as the round's own call would."""
        chunk, handle = self.prefill_chunk, gen.handle
        while not gen.closed:  # handle.cursor is read afresh: a round may replace it meanwhile
            start = handle.cursor.draft_len if kind == "draft" else handle.cursor.target_len
            if not self._chunk_calls(len(handle.committed) - start):
                return
            feed = handle.committed[start : start + chunk]
            if kind == "draft":
                ref = CacheRef(handle.session_id, handle.epoch, start, feed)
                request = replica_pb2.ProposeRequest(cache=ref_pb(ref), num_tokens=1, sampling=gen.params_pb)
                await gen.links.propose(handle.draft_replica, request, self._timeout(gen.deadline))
                handle.cursor.draft_len = max(handle.cursor.draft_len, start + chunk)
            else:
                ref = CacheRef(handle.session_id, handle.epoch, start, feed, handle.cursor.target_resync)
                request = replica_pb2.VerifyRequest(cache=ref_pb(ref), sampling=gen.params_pb)
                t0 = time.perf_counter()
                await gen.links.verify(handle.target_replica, request, self._timeout(gen.deadline))
                gen.stats.verify_ms += (time.perf_counter() - t0) * 1000
                handle.cursor.target_len, handle.cursor.target_resync = start + chunk, False

    def _chunk_calls(self, lacking: int) -> int:
        """The calls of their own `_feed_in_chunks` makes for a cache `lacking` this many tokens."""
        return (lacking - 1) // self.prefill_chunk if self.prefill_chunk and lacking > 0 else 0

    def _on_error(self, exc: grpc.aio.AioRpcError, handle: SessionHandle, kind: str, deadline,
                  stats: Stats) -> None:
        """Decide what a failed internal call means for the session."""
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("the client's deadline passed during generation")
        address = handle.draft_replica if kind == "draft" else handle.target_replica
        if code in CACHE_LOST:  # evicted or out of step: rebuild this replica's cache
            log.info("%s %s lost session %s (%s); rebuilding", kind, address, handle.session_id, exc.details())
            if kind == "draft":
                handle.cursor.draft_len = 0
            else:
                handle.cursor.target_len, handle.cursor.target_resync = 0, True
            return
        if code in REPLICA_DOWN:
            log.warning("%s replica %s failed (%s: %s); re-homing session %s", kind, address, code.name,
                        exc.details(), handle.session_id)
            self.pools.mark_down(address)
            metrics.FAILOVERS.labels(kind).inc()
            stats.failovers += 1
            if kind == "draft":
                handle.draft_replica = ""
            else:
                handle.target_replica = ""
            return
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded(f"{kind} replica {address} is full: {exc.details()}")
        raise InvalidRequest(f"{kind} replica refused the call: {exc.details()}")

    # ----------------------------------------------------------------- overlapped drafting
    async def _predraft(self, gen: "_Generation", start: int, feed: list[int], num_tokens: int,
                        fork: bool = False) -> replica_pb2.ProposeResponse | None:
        """While the target verifies round k, draft round k+1 on a prefix it may end with.
        The main pre-draft (`fork` False) assumes round k accepted in full: it feeds the
        draft tokens the draft's cache lacks, guesses the bonus token (under the target's
        own noise for it: sampling.bonus_guess_rows) and drafts on after it. A fork feeds a
        rejected round's likely correction instead, in a private copy of the cache.
        One attempt; any failure just means no pre-draft."""
        handle = gen.handle
        request = replica_pb2.ProposeRequest(
            cache=ref_pb(CacheRef(handle.session_id, handle.epoch, start, feed)),
            num_tokens=num_tokens, sampling=gen.params_pb, guess_bonus=not fork, stop_below=gen.stop_below,
            runner_ups=self._forks_wanted(gen), fork=fork)
        try:
            resp = await gen.links.propose(handle.draft_replica, request, self._timeout(gen.deadline),
                                           ordered=not fork)
        except (grpc.aio.AioRpcError, DeadlineExceeded):
            return None
        gen.stats.wire_bytes += resp.ByteSize()
        return resp

    async def _take_predraft(self, gen: "_Generation", ahead: _Ahead, verdict, gamma: int):
        """→ the next round's (tokens, distributions, γ, runner-ups, line) from a pre-draft
        the verdict made right, or None. A wasted pre-draft on a stream is left to finish
        (it usually has: drafting is the shorter half of a round); the next call on that
        stream queues behind it, where cancelling would cost the stream."""
        kept = ahead.main
        if self.calls == "unary":
            for j, (_, _, task) in ahead.forks.items():
                if j != verdict.accepted:
                    task.cancel()
            if verdict.accepted < gamma and kept is not None:
                kept.cancel()
        if verdict.accepted < gamma:
            if kept is not None:
                metrics.OVERLAP.labels("attempt").inc()
                self.costs.observe_predraft(gen.policy.greedy, False)
            return await self._take_fork(gen, ahead, verdict)
        if kept is None:
            return None
        metrics.OVERLAP.labels("attempt").inc()
        return await self._take_main(gen, kept, verdict)

    async def _take_fork(self, gen: "_Generation", ahead: _Ahead, verdict):
        """A rejected round's fork, if it was drafted from the token the target corrected
        to: greedy drafting is a function of the prefix, so its tokens are a draft the
        next round could have made (and the target checks every draft token anyway). The
        draft's own cache then holds the committed tokens up to the fork's base only."""
        fork = ahead.forks.get(verdict.accepted)
        if fork is None:
            return None
        guess, base, task = fork
        gen.policy.observe_runner_up(guess == verdict.next_token)
        if guess != verdict.next_token:
            if self.calls == "unary":
                task.cancel()
            return None
        spec = await self._in_time(gen, task)
        if spec is None or not spec.draft_tokens:
            return None
        metrics.OVERLAP.labels("fork_hit").inc()
        gen.stats.overlap_hits += 1
        return list(spec.draft_tokens), None, len(spec.draft_tokens), list(spec.runner_ups) or None, base

    async def _take_main(self, gen: "_Generation", ahead: asyncio.Task, verdict):
        """The main pre-draft, kept only if its bonus token is the one the draft guessed;
        the rest was drafted on exactly the committed prefix, with the same per-position
        randomness, so it is the draft the next round would have made."""
        greedy = gen.policy.greedy
        spec = await self._in_time(gen, ahead)
        if gen.late is ahead:
            return None
        if spec is None or len(spec.draft_tokens) < 2:  # no draft after the guess
            self.costs.observe_predraft(greedy, False)
            return None
        gen.policy.observe_guess(spec.draft_tokens[0] == verdict.next_token)
        self.costs.observe_predraft(greedy, spec.draft_tokens[0] == verdict.next_token)
        if spec.draft_tokens[0] != verdict.next_token:
            return None
        metrics.OVERLAP.labels("hit").inc()
        gen.stats.overlap_hits += 1
        # a greedy proposal has no distributions
        dists = to_pb(drop_first_rows(from_pb(spec.distributions), 1)) if spec.HasField("distributions") else None
        tokens = list(spec.draft_tokens[1:])
        return tokens, dists, len(tokens), list(spec.runner_ups[1:]) or None, None

    # ----------------------------------------------------------------- the loop
    async def run(self, req: GenerationRequest, emit: Emit, deadline: float | None = None) -> Outcome:
        t_start = time.perf_counter()
        owner = f"{id(self)}:{random.getrandbits(32)}"
        handle = await self._open(req, owner)
        gen = self._begin(req, handle, deadline)
        gen.stats.started = t_start
        generated, reason = [], "length"
        pre = None  # (tokens, distributions, γ) drafted while the previous round was verified
        pending: asyncio.Future | None = None  # the previous round's commit, then its emit
        release: asyncio.Event | None = None  # lets that commit go (_finish_round)
        metrics.ACTIVE_SESSIONS.inc()
        self.active += 1
        try:
            while len(generated) < req.max_new_tokens:
                t_round, calls_before = time.perf_counter(), gen.stats.draft_ms + gen.stats.verify_ms
                active = self.active
                if gen.governed:
                    mode = self.governor.speculating(gen.policy.greedy, active)
                    gen.rounds_in_mode = gen.rounds_in_mode + 1 if mode == gen.speculating else 1
                    gen.speculating = mode
                m = len(handle.committed)
                if m >= self.max_len:
                    reason = "context"
                    break
                await self._probe_draft_pool(gen)
                remaining = req.max_new_tokens - len(generated)
                if pre is not None:
                    draft_tokens, dists, gamma, gen.runner_ups, gen.line = pre
                else:
                    draft_tokens, dists, gamma = await self._draft(gen, remaining, m)
                ahead = self._start_predraft(gen, draft_tokens, gamma, remaining, m)
                plain = pre is None and ahead is None and bool(generated)  # own calls only, past the prefill
                if release is not None:
                    release.set()  # the previous round's commit follows this verification out
                verdict = await self._verify_round(gen, draft_tokens, dists, ahead)
                pre = None if ahead is None else await self._take_predraft(gen, ahead, verdict, gamma)
                new, out_text, reason = self._apply(gen, m, gamma, draft_tokens, verdict)
                generated.extend(new)
                if pending is not None:
                    await pending  # rounds are committed and streamed in order
                book = _Round(gamma, verdict.accepted, tuple(verdict.keep_chances), len(new), active,
                              gen.speculating, gen.rounds_in_mode, time.perf_counter() - t_round,
                              gen.stats.draft_ms + gen.stats.verify_ms - calls_before, plain, tuple(gen.calls))
                gen.calls.clear()
                release, pending = self._end_round(gen, book, new, out_text, emit, first=len(generated) == len(new))
                if reason in ("eos", "stop"):
                    break
            if pending is not None:
                release.set()
                await pending
            tail = gen.text.flush()
            if tail:
                await emit(tail, [])
        finally:
            gen.closed = True
            if release is not None:
                release.set()
            metrics.ACTIVE_SESSIONS.dec()
            self.active -= 1
            # shielded: a second cancellation (the server's deadline firing while the loop
            # winds down) must not cut the release of the caches short
            await asyncio.shield(self._close(handle, req, owner, pending, gen.links, gen.late))
        metrics.TOKENS.inc(len(generated))
        return Outcome(handle.session_id, generated, reason, gen.stats, gen.prompt_len, req.params.seed,
                       handle.draft_replica, handle.target_replica, (time.perf_counter() - t_start) * 1000)

    def _record_round(self, gen: "_Generation", book: "_Round") -> None:
        """What a round and its calls tell the stats, the shared cost model, the load governor
        and the metrics. None of it decides the next round's call, so it runs after that call has left
        (`_finish_round`), a round late for the next choice.

        A plain round's time outside its two calls (the loop's own work, waiting for the
        previous commit) is added by the cost model to every γ's round: paid once a
        round, it favours rounds that yield more tokens."""
        policy = gen.policy
        for call in book.calls:
            self._note_call(gen.stats, call)
        self.costs.observe_acceptance(policy.greedy, book.gamma, book.accepted, book.chances)
        if book.plain:
            self.costs.observe_round_overhead(book.seconds * 1000 - book.calls_ms, book.calls_ms)
        if gen.governed:
            self.governor.observe(policy.greedy, book.active, book.speculating, book.tokens, book.seconds,
                                  book.rounds_in_mode)
        metrics.ROUNDS.inc()
        metrics.GAMMA.observe(book.gamma)
        if book.gamma:
            metrics.DRAFTED.inc(book.gamma)
            metrics.ACCEPTED.inc(book.accepted)
            metrics.ACCEPTED_LENGTH.observe(book.accepted)
            for i in range(book.gamma):
                metrics.at_position(metrics.DRAFTED_AT_POSITION, i).inc()
                if i < book.accepted:
                    metrics.at_position(metrics.ACCEPT_AT_POSITION, i).inc()

    def _note_call(self, stats: Stats, call: _Call) -> None:
        """A call's network time, bytes (sizing a message serializes it: 32 KB for a sampled
        proposal), cost sample (steady rounds only: a prefill is no measure of a round's
        call; nor is a verification that rebuilt the target's cache) and stage metric."""
        resp = call.response
        stats.network_ms += max(0.0, call.ms - resp.compute_ms)
        stats.wire_bytes += resp.ByteSize() + (call.request.ByteSize() if call.request is not None else 0)
        if call.pool == "draft":
            if call.steady:
                self.costs.observe_draft(len(resp.draft_tokens), call.ms, resp.compute_ms, resp.batch_size)
            if len(resp.draft_tokens) < call.tokens:
                metrics.DRAFT_STOPS.inc()
            metrics.DRAFT_STAGE.observe(call.ms / 1000)
            return
        if call.steady and not resp.resynced:
            self.costs.observe_verify(call.tokens, call.ms, resp.batch_size, resp.compute_ms, resp.batch_tokens)
        metrics.VERIFY_STAGE.observe(call.ms / 1000)

    def _begin(self, req: GenerationRequest, handle: SessionHandle, deadline: float | None) -> "_Generation":
        p = req.params
        return _Generation(
            handle, deadline, SessionLinks(self.pools, self.calls), Stats(),
            SessionPolicy(fixed=req.gamma, deterministic=req.seeded and p.temperature > 0, greedy=p.greedy),
            TextStream(self.tokenizer, req.stop),
            replica_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed),
            0.0 if req.gamma is not None else self.stop_below[0 if p.greedy else 1],
            len(handle.committed), time.monotonic())

    async def _probe_draft_pool(self, gen: "_Generation") -> None:
        """A session decoding target-only for want of a draft replica looks for one again
        now and then: a draft may have come back."""
        if not gen.handle.draft_replica and time.monotonic() - gen.last_draft_probe > 1.0:
            gen.last_draft_probe = time.monotonic()
            gen.handle.draft_replica = await self.pools.pick("draft") or ""
            gen.handle.cursor.draft_len = 0

    async def _in_time(self, gen: "_Generation", task: asyncio.Future, calls: int = 1):
        """→ the draft call's result, or None where it has not come within `draft_wait` for
        each of its `calls`: the call is then left to finish on its own (`gen.late`) and the
        round goes on target-only, which keeps the output law (a round's γ may be anything).
        A seeded sampled session waits the call out instead: its tokens depend on where
        its rounds end, and it must reproduce (a replica that fails is replaced anyway)."""
        if not task.done():
            wait = self._wait_for(gen)
            wait = None if wait is None else wait * calls
            try:
                await asyncio.wait((task,), timeout=wait)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if not task.done():
                gen.late = task
                self._note_stall(gen.handle.draft_replica, task)
                metrics.DRAFT_LATE.inc()
                log.info("draft replica %s has not answered session %s within %.0f ms; going on target-only "
                         "until it does", gen.handle.draft_replica, gen.handle.session_id, wait * 1000)
                return None
        return task.result()

    def _wait_for(self, gen: "_Generation") -> float | None:
        """Seconds this session waits for a draft call (None: until it ends)."""
        return None if gen.policy.deterministic else self.draft_wait

    def _note_stall(self, address: str, task: asyncio.Future) -> None:
        """A replica owes a late call until that call ends: the other sessions on it skip
        their drafts meanwhile rather than each wait `draft_wait` for it to answer."""
        self._stalled[address] = self._stalled.get(address, 0) + 1

        def ended(_: asyncio.Future) -> None:
            left = self._stalled.pop(address, 1) - 1
            if left:
                self._stalled[address] = left

        task.add_done_callback(ended)

    def _draft_ready(self, gen: "_Generation") -> bool:
        """Whether the session may call its draft replica: not while a call it stopped
        waiting for is out, nor while that replica owes another session a late call
        (except a seeded sampled session, which waits its calls out, `_in_time`)."""
        if gen.late is not None:
            if not gen.late.done():
                return False
            self._settle_late(gen)
        return not self._stalled or gen.handle.draft_replica not in self._stalled or gen.policy.deterministic

    def _settle_late(self, gen: "_Generation") -> None:
        """A late call has ended. A late proposal that did come fed the draft's cache the
        committed tokens it carried, which the next call need not feed again."""
        late, gen.late = gen.late, None
        if late.cancelled():
            return
        exc = late.exception()
        if exc is not None:  # its own failure handling has run (`_propose`); nothing to add
            log.info("a late draft call of session %s failed: %s", gen.handle.session_id, exc)
            return
        got = late.result()
        if isinstance(got, _Proposal):  # a pre-draft fed nothing the cursor counts
            cursor = gen.handle.cursor
            fed = got.ref.start + len(got.ref.tokens)
            cursor.draft_len = max(cursor.draft_len, min(fed, len(gen.handle.committed) - 1))

    async def _draft(self, gen: "_Generation", remaining: int,
                     m: int) -> tuple[list[int], replica_pb2.DraftDistributions | None, int]:
        """This round's proposal → (draft tokens, their distributions or None, γ); γ = 0
        (target-only) when the policy says so or no draft replica can serve."""
        ready = gen.handle.draft_replica and gen.speculating and self._draft_ready(gen)
        want = gen.policy.choose(self.costs) if ready else 0
        gamma = rounds.plan_gamma(want, remaining, m, self.max_len)
        gen.runner_ups, gen.line = None, None
        if gamma == 0:
            return [], None, 0
        # a long feed goes in chunks (`_feed_in_chunks`), a call each, and each call gets the wait
        chunks = self._chunk_calls(m - gen.handle.cursor.draft_len)
        if self._wait_for(gen) is None:  # no task needed to wait the call out
            got = await self._propose(gen, gamma)
        else:
            got = await self._in_time(gen, asyncio.ensure_future(self._propose(gen, gamma)), 1 + chunks)
        if got is None:
            return [], None, 0
        prop = got.response
        gen.stats.draft_ms += got.ms
        gen.calls.append(_Call("draft", got.ms, None, prop, len(got.ref.tokens) <= 2, gamma))
        gen.runner_ups = list(prop.runner_ups) or None
        dists = prop.distributions if prop.HasField("distributions") else None
        return list(prop.draft_tokens), dists, len(prop.draft_tokens)  # the confidence stop may have cut it

    def _start_predraft(self, gen: "_Generation", draft_tokens: list[int], gamma: int, remaining: int,
                        m: int) -> _Ahead | None:
        """Pre-draft round k+1 beside round k's verification, when that is likely to pay:
        the main pre-draft when the round is likely to be accepted in full with the bonus
        guessed right, forks (`_likely_forks`) on the likely rejections; otherwise it is
        draft work thrown away, which also slows the verification it runs beside on
        shared cores."""
        policy = gen.policy
        if not (self.overlap and policy.fixed is None and gamma > 0 and gen.handle.draft_replica
                and gen.speculating and self._draft_ready(gen)):
            return None
        main = policy.predraft_hit(gamma) >= self.overlap_min_hit
        if main and not self.costs.predraft_pays(policy.greedy, self.overlap_min_use):
            metrics.OVERLAP.labels("skipped").inc()
            main = False
        forks = self._likely_forks(gen, gamma)
        if not (main or forks):
            return None
        want = policy.choose(self.costs)  # one choice a round: choose counts the rounds it makes
        ahead = _Ahead()
        # the draft's cache holds the committed tokens and the draft up to its last token,
        # or, after a fork, the committed tokens up to gen.line: feed what it lacks
        line = m + gamma - 1 if gen.line is None else gen.line
        seq = gen.handle.committed + draft_tokens
        g2 = rounds.plan_gamma(want, remaining - gamma - 1, m + gamma + 1, self.max_len) if main else 0
        if g2 > 0:
            ahead.main = asyncio.create_task(self._predraft(gen, line, seq[line:], g2 + 1))
        for j in forks:
            g = rounds.plan_gamma(want, remaining - j - 1, m + j + 1, self.max_len)
            if g > 0:
                base = min(line, m + j)
                feed = seq[base : m + j] + [gen.runner_ups[j]]
                task = asyncio.create_task(self._predraft(gen, base, feed, g, fork=True))
                ahead.forks[j] = (gen.runner_ups[j], base, task)
                metrics.OVERLAP.labels("fork").inc()
        return ahead if ahead.tasks() else None

    def _forks_wanted(self, gen: "_Generation") -> bool:
        """Whether this session pre-drafts forks: greedy (a fork's guess is the draft's
        runner-up, the correction a greedy target most often makes), adaptive, and only
        while sessions have the target to themselves: alone, a fork costs draft time that
        would idle during the verification; under load it would cost other sessions."""
        policy = gen.policy
        return (self.overlap and self.overlap_forks > 0 and policy.greedy and policy.fixed is None
                and self.costs.alone)

    def _likely_forks(self, gen: "_Generation", gamma: int) -> list[int]:
        """The kept lengths j worth a fork, likeliest first: each fork feeds the draft's
        runner-up at position j + 1 (what the target would correct to) on the committed
        tokens and the first j draft tokens, and drafts the next round after it."""
        ups = gen.runner_ups
        if not (self._forks_wanted(gen) and ups and len(ups) >= gamma):
            return []
        chances = gen.policy.branch_chances(gamma)
        likely = sorted((j for j in range(gamma) if chances[j] >= FORK_MIN_HIT), key=lambda j: -chances[j])
        return likely[: self.overlap_forks]

    async def _verify_round(self, gen: "_Generation", draft_tokens: list[int],
                            dists: replica_pb2.DraftDistributions | None, ahead: _Ahead | None):
        """The round's verification; a pre-draft beside it is cancelled if it fails."""
        try:
            return await self._verify(gen, draft_tokens, dists)
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise

    def _apply(self, gen: "_Generation", m: int, gamma: int, draft_tokens: list[int],
               verdict) -> tuple[list[int], str | None, str]:
        """The verdict's tokens, cut after EOS or where a stop string ends, committed to the
        handle → (the new tokens, their text or None, the finish reason so far). Only stop
        strings make the text decide the tokens; without them the text is decoded after the
        next round's call has left (`_finish_round`), and None is returned for it."""
        new = rounds.new_tokens(draft_tokens, verdict.accepted, verdict.next_token)
        reason = "length"
        if self.eos_id is not None and self.eos_id in new:
            new = new[: new.index(self.eos_id) + 1]
            reason = "eos"
        text = None
        if gen.text.stop:
            text, kept = gen.text.push(new)
            if gen.text.stopped:
                new, reason = new[:kept], "stop"
        handle = gen.handle
        handle.committed.extend(new)
        handle.cursor = rounds.advance(handle.cursor, m, gamma, verdict.accepted, verdict.cache_length, len(new))
        if gen.line is not None:  # this round's draft was a fork's: the draft's cache lacks it
            handle.cursor.draft_len = min(handle.cursor.draft_len, gen.line)
        # a seeded session's policy counts its kept length, a function of its own tokens
        # only, so that the same request yields the same rounds; others learn from the
        # target's keep chances of a sampled draft (gamma_policy.keep_chances)
        gen.stats.observe(gamma, verdict.accepted)
        gen.policy.observe(gamma, verdict.accepted, None if gen.policy.deterministic else verdict.keep_chances)
        return new, text, reason

    def _end_round(self, gen: "_Generation", book: "_Round", new: list[int], text: str | None, emit: Emit,
                   first: bool) -> tuple[asyncio.Event, asyncio.Future]:
        """→ (its release, its finish): the round's bookkeeping, Redis round trip and emit,
        which overlap the next round's verification (the first round's go at once, for the
        time to first token); its tokens reach the client only once they are committed.
        The commit is taken from the handle here: the next round's `_apply` may change the
        handle before the finish runs (tests/orchestrator/test_generation.py)."""
        release = asyncio.Event()
        if first:
            release.set()
        commit = self.store.round_commit(gen.handle, new)
        return release, asyncio.ensure_future(self._finish_round(release, gen, book, commit, new, text, emit))

    async def _finish_round(self, release: asyncio.Event, gen: "_Generation", book: "_Round", commit: RoundCommit,
                            new: list[int], text: str | None, emit: Emit) -> None:
        """A round's bookkeeping, its Redis commit, then its tokens to the client, once
        `release` is set: when the next round's verification has been issued (or the loop
        ends). Started at once, the commit's Redis command went out before the next round's
        first call, which MuxLink writes a turn later, and its wake-up of Redis sat on the
        round's critical path: 0.43–0.45 ms from a verification's answer to the next
        proposal's frame at one greedy stream against 0.29 ms deferred
        (benchmarks/HISTORY.md). `CALL_TURNS` more turns let the verification's own write go
        first; the target's forward then covers the rest. Rounds finish in order (the loop
        awaits each before the next), so their text is decoded in order."""
        await release.wait()
        for _ in range(CALL_TURNS):
            await asyncio.sleep(0)
        self._record_round(gen, book)
        if text is None:
            text = gen.text.push(new)[0]
        stats = gen.stats
        t0 = time.perf_counter()
        await self.store.commit(commit)
        stats.redis_ms += (time.perf_counter() - t0) * 1000
        await emit(text, new)
        if new and not stats.first_token_ms:
            stats.first_token_ms = (time.perf_counter() - stats.started) * 1000

    async def _close(self, handle: SessionHandle, req: GenerationRequest, owner: str,
                     pending: asyncio.Future | None = None, links: SessionLinks | None = None,
                     late: asyncio.Task | None = None) -> None:
        """Ephemeral sessions are released on both replicas and their handle deleted;
        kept sessions are unlocked for the next call. A round's commit still in flight
        (the loop ended by an error or a cancellation) lands first, so that it cannot
        recreate a handle deleted here. A draft call still late is left to end on its own
        (it keeps its replica marked stalled for the other sessions, `_note_stall`), and a
        stalled replica is released in the background: the answer does not wait on a
        replica that has stopped answering."""
        draft_late = late is not None and not late.done() or handle.draft_replica in self._stalled
        if late is not None:
            self._in_background(late)
        if pending is not None:
            await asyncio.wait([pending])
            if not pending.cancelled():
                pending.exception()  # already raised by the loop, or superseded by its error
        if links is not None:  # a generation's own streams ("stream" mode) close after their calls
            if draft_late:
                self._in_background(asyncio.ensure_future(links.close()))
            else:
                await links.close()
        keep = req.keep_session or bool(req.session_id)
        if keep:
            await self.store.unlock(handle.session_id, owner)
            return
        await self.release(handle, draft_in_background=draft_late)

    async def release(self, handle: SessionHandle, draft_in_background: bool = False) -> None:
        async def release_on(kind: str, address: str) -> None:
            if not address:
                return
            stub = self.pools.draft(address) if kind == "draft" else self.pools.target(address)
            try:
                await stub.Release(replica_pb2.ReleaseRequest(session_id=handle.session_id), timeout=2.0)
            except grpc.aio.AioRpcError:
                pass  # the replica is gone or will evict the idle cache itself

        async def release_draft() -> None:  # waited for `draft_wait` at most, as its calls are
            draft = asyncio.ensure_future(release_on("draft", handle.draft_replica))
            if not draft_in_background:
                await asyncio.wait((draft,), timeout=self.draft_wait)
            if not draft.done():
                self._in_background(draft)

        await asyncio.gather(release_draft(), release_on("target", handle.target_replica))
        try:
            await self.store.delete(handle.session_id)
        except Unavailable:
            pass  # the handle expires by TTL

    def _in_background(self, task: asyncio.Future) -> None:
        """Hold a task that outlives its generation until it ends, and take its outcome
        (its failure was handled where it arose)."""
        def ended(done: asyncio.Future) -> None:
            self._background.discard(done)
            if not done.cancelled():
                done.exception()

        self._background.add(task)
        task.add_done_callback(ended)
