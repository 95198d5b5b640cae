"""The speculate → verify → correct loop across the two pools.

Per round: one draft call, one target call, one Redis commit (a single script call, sent in
one write with the other sessions' commits of the same loop turn). Replica failures
are absorbed here: a dead replica is replaced by a live one of its pool and the cache is
rebuilt from the committed tokens; with no draft replica left the loop goes on
target-only and picks speculation up again when a draft returns. A draft replica that is
there but does not answer (a pause, a hang, a queue far too long) is not waited for beyond
`draft_wait`: the round goes on target-only and the session drafts again once the replica
has answered (orchestrator/draft_waits.py). While the target verifies a round, the
draft may already draft the next (orchestrator/predraft.py). A long feed (a prompt's prefill, a cache rebuilt on
another replica) goes to a replica in chunks of `prefill_chunk` tokens, a call each, so
that no batched forward there holds the other sessions for a whole long prompt
(`Generator._feed_in_chunks`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace

import grpc

from orchestrator import ngram, request_ids, round_book
from orchestrator.draft_waits import DraftWaits
from orchestrator.gamma_policy import CostModel, SessionPolicy
from orchestrator.governor import LoadGovernor
from orchestrator.loop_state import (Call, Emit, Generation, GenerationRequest, InFlight, Opened, Outcome, PromptScores,
                                     Proposal, Round, Stats)
from orchestrator.pools import CACHE_LOST, REPLICA_DOWN, PoolClients, prefix_affinity
from orchestrator.predraft import OVERLAP_FORKS, OVERLAP_MIN_HIT, OVERLAP_MIN_USE, Ahead, PreDrafter
from orchestrator.round_stream import SessionLinks
from orchestrator.text import TextStream
from specdec import logprob_records, metrics, rounds
from specdec.cache_ref import CacheRef
from specdec.encoding import point_masses
from specdec.errors import (DeadlineExceeded, InvalidRequest, Overloaded, PreconditionFailed, RequestSuperseded,
                            Unavailable)
from specdec.internal.v1 import replica_pb2
from specdec.rounds import Ends
from specdec.sampling_params import GREEDY_BELOW, shapes
from specdec.session_store import AnswerScores, RoundCommit, SessionHandle, SessionStore
from specdec.wire_pb import params_to_pb, ref_to_pb, to_pb

__all__ = ["DRAFT_WAIT_S", "PREFILL_CHUNK", "STOP_BELOW_GREEDY", "STOP_BELOW_SAMPLED", "OVERLAP_FORKS",
           "OVERLAP_MIN_HIT", "OVERLAP_MIN_USE", "GenerationRequest", "Generator", "Outcome", "Stats"]

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 4
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
# (orchestrator/draft_waits.py): a replica that stalls (a pause, a hang, a queue far too long)
# costs its sessions this wait once instead of the whole stall
DRAFT_WAIT_S = 0.25
# how a call's first round is drafted (--first-round): as any round, or by no draft replica,
# so that the first token streams after the target's prefill alone (the default: the draft
# prefills the prompt and drafts the second round beside it, PreDrafter.start; by
# turns as many tokens/s and a first token 8 ms in rather than 13, benchmarks/HISTORY.md)
FIRST_ROUNDS = ("speculate", "target")
# a feed longer than this many tokens (a prompt's prefill, a cache rebuilt elsewhere) goes to
# a replica as calls of this many tokens (`Generator._feed_in_chunks`): one batched forward
# over a whole long prompt holds every other session in it for as long (about 1 s for
# 2,000 tokens on the bundled target here), a chunk only for its share
PREFILL_CHUNK = 256
# a whole answer to a request with an id, on a session not kept, stays in Redis this many
# seconds (its handle, without caches), so that a retry whose answer was lost gets it again
RETRY_WINDOW_S = 120

# a timed-out internal call within this of the client's deadline was cut by that deadline: the
# timers that cut it fire up to a millisecond early (uvloop's count whole milliseconds)
DEADLINE_SLACK_S = 0.005


def deadline_passed(deadline: float | None, now: float) -> bool:
    """Whether an internal call that timed out at `now` ran into the client's deadline,
    rather than a replica falling silent. Read strictly (now ≥ deadline), a call cut a
    fraction of a millisecond early by its timer marked a healthy target replica down and
    answered the client UNAVAILABLE ("no live target replica ... beyond the 1 that failed
    this call") instead of DEADLINE_EXCEEDED (tests/e2e/test_access_log.py, 2026-12-06)."""
    return deadline is not None and now >= deadline - DEADLINE_SLACK_S


class Generator:
    """Runs generations: opens or resumes a session's handle, loops rounds to the end, and
    releases the caches. Knows the pools and the session store, not gRPC's public side."""

    def __init__(self, pools: PoolClients, store: SessionStore, tokenizer, max_len: int,
                 costs: CostModel | None = None, call_timeout: float = 30.0, overlap: bool = True,
                 overlap_min_hit: float = OVERLAP_MIN_HIT, overlap_min_use: float = OVERLAP_MIN_USE,
                 calls: str = "mux", overlap_forks: int = OVERLAP_FORKS,
                 stop_below: tuple[float, float] = (STOP_BELOW_GREEDY, STOP_BELOW_SAMPLED),
                 governor: LoadGovernor | None = None, draft_wait: float | None = DRAFT_WAIT_S,
                 prefill_chunk: int = PREFILL_CHUNK, retry_window: int = RETRY_WINDOW_S,
                 lookup: str = "greedy", end_ids: frozenset[int] | None = None,
                 first_round: str = "target") -> None:
        self.pools = pools
        self.store = store
        self.tokenizer = tokenizer
        # the model's end-of-sequence tokens (specdec.model_files.end_token_ids); the tokenizer's EOS by default
        self.end_ids = frozenset({tokenizer.eos_token_id} - {None}) if end_ids is None else end_ids
        self.max_len = max_len
        self.costs = costs or CostModel()
        self.call_timeout = call_timeout
        self.calls = calls  # how Propose/Verify travel: round_stream.CALL_MODES
        self.stop_below = stop_below  # (greedy, sampled): the adaptive proposals' confidence stop
        self.governor = governor or LoadGovernor()  # speculation on or off under load, by measurement
        self.active = 0  # generations in flight in this process: the governor's load
        self._closing: set[asyncio.Task] = set()  # generations' ends still releasing their sessions
        self.prefill_chunk = prefill_chunk  # tokens a call feeds at most before the round's own (0: no limit)
        self.retry_window = retry_window  # seconds a request id's whole answer stays for its retries
        self.waits = DraftWaits(draft_wait)
        self.lookup = ngram.lookup_mode(lookup)  # which sessions may draft by prompt lookup (ngram.MODES)
        self.lookup_rates = ngram.LookupRates()  # a new sampled session's lookup prior: the recent rate
        if first_round not in FIRST_ROUNDS:
            raise ValueError(f"first_round must be one of {', '.join(FIRST_ROUNDS)}, not {first_round!r}")
        self.first_round = first_round  # target: a call's first round is the target's prefill alone
        # pre-draft the next round during verification (adaptive γ only)
        self.predraft = PreDrafter(self.costs, self.waits, self._timeout, max_len, calls, overlap,
                                   overlap_min_hit, overlap_min_use, overlap_forks, max_feed=prefill_chunk)

    # ----------------------------------------------------------------- session set-up
    async def _open(self, req: GenerationRequest, owner: str) -> Opened:
        """The session's handle, held by this call (`SessionStore.acquire`) until `_close`,
        the request's prompt appended and saved, or found appended by an earlier attempt
        of the same request id (`request_ids`): a retry appends nothing. A call refused
        here leaves the session free."""
        named = req.session_id or (request_ids.session_for(req.request_id) if req.request_id else "")
        handle = await self.store.acquire(named, owner, create=not req.session_id) if named else None
        if handle is None:  # a new session
            try:
                affinity = prefix_affinity(req.prompt_ids)  # where a prompt that begins alike is held
                target = await self.pools.require("target", affinity=affinity)
                draft = await self.pools.pick("draft", affinity=affinity) or ""
            except BaseException:
                if named:  # its lock, taken by `acquire`
                    await self.store.unlock(named, owner)
                raise
            handle = SessionHandle(named or self.store.new_id(), draft, target, 1, [], owner=owner,
                                   ephemeral=not named and not req.keep_session)
            if not named:
                await self.store.try_lock(handle.session_id, owner)
        try:
            marks = [request_ids.RequestMark.from_list(item) for item in handle.requests]
            mark = request_ids.find(marks, req.request_id) if req.request_id else None
            if mark is not None:
                return self._retried(req, handle, mark)
            before = len(handle.committed)
            handle.committed.extend(req.prompt_ids)
            if not handle.committed:
                raise InvalidRequest("the prompt is empty: give prompt text or prompt_token_ids")
            if len(handle.committed) >= self.max_len:
                raise InvalidRequest(f"the prompt ({len(handle.committed)} tokens with the session's history) "
                                     f"leaves no room in the model context of {self.max_len} tokens")
            handle.params = {"temperature": req.params.temperature, "top_k": req.params.top_k,
                             "top_p": req.params.top_p, "seed": req.params.seed}
            handle.policy = ""  # the previous request's
            if req.request_id or handle.requests:  # saved with the prompt in one write: a retry finds both or neither
                marks = request_ids.record(marks, req.request_id, req.fingerprint, before, len(handle.committed))
                handle.requests = [m.to_list() for m in marks]
            await self.store.save(handle)
        except BaseException:
            await self.store.unlock(handle.session_id, owner)
            raise
        return Opened(handle, len(handle.committed))

    @staticmethod
    def _retried(req: GenerationRequest, handle: SessionHandle, mark: request_ids.RequestMark) -> Opened:
        """A request an earlier call with the same id began: the same fields, or refused."""
        if mark.fingerprint != req.fingerprint:
            raise InvalidRequest(f"request_id {req.request_id!r} was used for a different request on this session "
                                 "(its prompt or parameters differ); a new request needs a new id")
        older = mark.end >= 0
        return Opened(handle, mark.start, request_ids.answer(handle.committed, mark), retry=True, older=older)

    async def _replay(self, gen: Generation, req: GenerationRequest, opened: Opened, emit: Emit) -> str | None:
        """A retried request's answer so far, to the client first → its finish reason where
        it is already whole, else None (the loop generates the rest)."""
        tokens = opened.resumed
        if not opened.retry:
            return None
        text = gen.text.push(tokens)[0] if tokens else ""
        reason = "stop" if gen.text.stopped else request_ids.finished(
            tokens, req.max_new_tokens, gen.ends, opened.start + len(tokens), self.max_len)
        if reason is None and opened.older:
            raise RequestSuperseded(
                f"request {req.request_id!r} was cut short after {len(tokens)} tokens and session "
                f"{gen.handle.session_id} has gone on to another request since; its answer cannot be continued")
        metrics.REQUESTS_RESUMED.labels("answered" if reason else "continued").inc()
        gen.stats.resumed = len(tokens)
        if tokens:
            await emit(text, list(tokens), await self._stored_scores(gen, req, opened) if gen.logprobs else None)
            gen.stats.first_token_ms = (time.perf_counter() - gen.stats.started) * 1000
        return reason

    async def _stored_scores(self, gen: Generation, req: GenerationRequest,
                             opened: Opened) -> list[logprob_records.TokenLogprob]:
        """The log-probabilities the earlier attempts committed with the resumed tokens."""
        data = await self.store.load_scores(gen.handle.session_id, opened.start)
        scores = logprob_records.unpack(data, gen.top_logprobs, len(opened.resumed))
        if scores is None:
            raise PreconditionFailed(f"the log-probabilities of request {req.request_id!r} are no longer kept (lost "
                                     "with a Redis that lost its writes); send it as a new request")
        return scores

    async def _stored_prompt_scores(self, gen: Generation, req: GenerationRequest, opened: Opened) -> None:
        """A retry's prompt log-probabilities, as its first attempt stored them before its
        first round's commit; where it committed none, they are gathered again (the retry's
        target calls feed the prompt again, its cache not being the handle's)."""
        data = await self.store.load_scores(gen.handle.session_id, opened.start, prompt=True)
        if not gen.prompt_scores.restore(data) and opened.resumed:
            raise PreconditionFailed(f"the prompt log-probabilities of request {req.request_id!r} are no longer "
                                     "kept (lost with a Redis that lost its writes); send it as a new request")

    # ----------------------------------------------------------------- one call each
    def _timeout(self, deadline: float | None) -> float:
        if deadline is None:
            return self.call_timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the client's deadline passed during generation")
        return min(left, self.call_timeout)

    async def _propose(self, gen: Generation, gamma: int) -> Proposal | None:
        """→ the proposal (at most γ tokens: fewer where the confidence stop cut it), or None
        when no draft replica can serve, or the generation ended while the call was late."""
        handle, deadline = gen.handle, gen.deadline
        failed: set[str] = set()  # the replicas this call found down: not tried again for it
        for _ in range(MAX_ATTEMPTS):
            if not handle.draft_replica:
                handle.draft_replica = await self.pools.pick(
                    "draft", exclude=failed, affinity=prefix_affinity(handle.committed)) or ""
                handle.cursor.draft_len = 0
                if not handle.draft_replica:
                    return None
            try:
                await self._feed_in_chunks(gen, "draft")
                if gen.closed:
                    return None
                ref = rounds.draft_ref(handle.session_id, handle.epoch, handle.committed, handle.cursor)
                request = replica_pb2.ProposeRequest(
                    cache=ref_to_pb(ref), num_tokens=gamma, sampling=gen.params_pb, stop_below=gen.stop_below,
                    runner_ups=self.predraft.forks_wanted(gen))
                t0 = time.perf_counter()
                resp = await gen.links.propose(handle.draft_replica, request, self._timeout(deadline))
            except grpc.aio.AioRpcError as exc:
                failed |= self._on_error(exc, handle, "draft", deadline, gen.stats)
                continue
            return Proposal(resp, ref, (time.perf_counter() - t0) * 1000)
        return None

    async def _verify(self, gen: Generation, draft_tokens: list[int],
                      dists: replica_pb2.DraftDistributions | None) -> replica_pb2.VerifyResponse:
        handle, stats, deadline = gen.handle, gen.stats, gen.deadline
        failed: set[str] = set()  # the replicas this call found down: not tried again for it
        for _ in range(MAX_ATTEMPTS):
            if not handle.target_replica:
                handle.target_replica = await self.pools.require(
                    "target", exclude=failed, affinity=prefix_affinity(handle.committed))
                handle.cursor.target_len, handle.cursor.target_resync = 0, True
            try:
                await self._feed_in_chunks(gen, "target")
                self._rewind_for_scores(gen)
                ref = rounds.target_ref(handle.session_id, handle.epoch, handle.committed, handle.cursor)
                request = replica_pb2.VerifyRequest(
                    cache=ref_to_pb(ref), draft_tokens=draft_tokens, distributions=dists, sampling=gen.params_pb,
                    processed_logprobs=gen.processed_logprobs)
                if gen.logprobs:
                    request.logprobs, request.top_logprobs = True, gen.top_logprobs
                scoring = self._ask_fed_scores(gen, request, ref)
                t0 = time.perf_counter()
                resp = await gen.links.verify(handle.target_replica, request, self._timeout(deadline))
                if scoring:
                    gen.prompt_scores.note(ref.start, resp)
            except grpc.aio.AioRpcError as exc:
                failed |= self._on_error(exc, handle, "target", deadline, stats)
                continue
            ms = (time.perf_counter() - t0) * 1000
            stats.verify_ms += ms
            gen.calls.append(Call("target", ms, request, resp, len(ref.tokens) <= 2, len(draft_tokens)))
            self._check_law(gen, resp)
            return resp
        raise Unavailable(f"the target pool could not verify session {handle.session_id} "
                          f"after {MAX_ATTEMPTS} attempts")

    async def _feed_in_chunks(self, gen: Generation, kind: str) -> None:
        """Feed a replica all but the last `prefill_chunk` tokens its cache lacks, a call of
        `prefill_chunk` tokens at a time, so that each of its batched forwards holds the
        other sessions in it for a chunk's share of a long prompt only. A chunk is a
        proposal of one token (the draft's cache runs ahead of the cursor, as after any
        proposal) or a verification without a draft (its next token is not used: the
        uniforms are counter-based, so a seeded request draws the same later on). Failures
        raise, as the round's own call would."""
        chunk, handle = self.prefill_chunk, gen.handle
        while not gen.closed:  # handle.cursor is read afresh: a round may replace it meanwhile
            if kind == "target":
                self._rewind_for_scores(gen)
            start = handle.cursor.draft_len if kind == "draft" else handle.cursor.target_len
            if not self._chunk_calls(len(handle.committed) - start):
                return
            feed = handle.committed[start : start + chunk]
            if kind == "draft":
                ref = CacheRef(handle.session_id, handle.epoch, start, feed)
                request = replica_pb2.ProposeRequest(cache=ref_to_pb(ref), num_tokens=1, sampling=gen.params_pb)
                await gen.links.propose(handle.draft_replica, request, self._timeout(gen.deadline))
                handle.cursor.draft_len = max(handle.cursor.draft_len, start + chunk)
            else:
                ref = CacheRef(handle.session_id, handle.epoch, start, feed, handle.cursor.target_resync)
                request = replica_pb2.VerifyRequest(cache=ref_to_pb(ref), sampling=gen.params_pb,
                                                    processed_logprobs=gen.processed_logprobs)
                scoring = self._ask_fed_scores(gen, request, ref)
                t0 = time.perf_counter()
                resp = await gen.links.verify(handle.target_replica, request, self._timeout(gen.deadline))
                self._check_law(gen, resp)
                if scoring:
                    gen.prompt_scores.note(start, resp)
                gen.stats.verify_ms += (time.perf_counter() - t0) * 1000
                handle.cursor.target_len, handle.cursor.target_resync = start + chunk, False

    @staticmethod
    def _check_law(gen: Generation, resp: replica_pb2.VerifyResponse) -> None:
        """A target replica from before min_p, processed log-probabilities or the logits'
        shaping (bias, min_tokens, penalties) ignores them (the fields are unknown to it):
        its reply, which echoes none, is refused rather than used, since the tokens or their
        numbers would not be what the request asked for."""
        replica = gen.handle.target_replica
        if resp.min_p != gen.params_pb.min_p and gen.params_pb.temperature >= GREEDY_BELOW:
            raise PreconditionFailed(f"target replica {replica} ignored min_p (a version from before it?); "
                                     "retry without min_p, or once the pool is upgraded")
        if gen.processed_logprobs and not resp.processed_logprobs:
            raise PreconditionFailed(f"target replica {replica} ignored processed_logprobs (a version from before "
                                     "it?); retry without it, or once the pool is upgraded")
        if gen.shapes and not resp.shaped:
            raise PreconditionFailed(f"target replica {replica} ignored the logit bias, min_tokens or penalties (a "
                                     "version from before them?); retry without them, or once the pool is upgraded")

    @staticmethod
    def _rewind_for_scores(gen: Generation) -> None:
        """Where the next target call would feed first a prompt token not scored yet, it
        feeds from the token before instead: that token's row is what predicts it."""
        scores, cursor = gen.prompt_scores, gen.handle.cursor
        if scores is not None and cursor.target_len > 0 and scores.missing(cursor.target_len):
            cursor.target_len, cursor.target_resync = cursor.target_len - 1, True

    @staticmethod
    def _ask_fed_scores(gen: Generation, request: replica_pb2.VerifyRequest, ref: CacheRef) -> bool:
        """Ask a target call for its fed tokens' log-probabilities where it feeds prompt
        tokens not scored yet (PromptScores) → whether it was asked."""
        if gen.prompt_scores is None or not gen.prompt_scores.wants(ref.start, len(ref.tokens)):
            return False
        request.fed_logprobs, request.top_logprobs = True, gen.top_logprobs
        return True

    def _chunk_calls(self, lacking: int) -> int:
        """The calls of their own `_feed_in_chunks` makes for a cache `lacking` this many tokens."""
        return rounds.chunk_calls(lacking, self.prefill_chunk)

    def _on_error(self, exc: grpc.aio.AioRpcError, handle: SessionHandle, kind: str, deadline,
                  stats: Stats) -> set[str]:
        """Decide what a failed internal call means for the session; → the replica it found
        down (the session moves off it), else nothing."""
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline_passed(deadline, time.monotonic()):
            raise DeadlineExceeded("the client's deadline passed during generation")
        address = handle.draft_replica if kind == "draft" else handle.target_replica
        if code in CACHE_LOST:  # evicted or out of step: rebuild this replica's cache
            log.info("%s %s lost session %s (%s); rebuilding", kind, address, handle.session_id, exc.details())
            if kind == "draft":
                handle.cursor.draft_len = 0
            else:
                handle.cursor.target_len, handle.cursor.target_resync = 0, True
            return set()
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
            return {address}
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded(f"{kind} replica {address} is full: {exc.details()}")
        raise InvalidRequest(f"{kind} replica refused the call: {exc.details()}")

    # ----------------------------------------------------------------- the loop
    async def run(self, req: GenerationRequest, emit: Emit, deadline: float | None = None) -> Outcome:
        """One call's answer: its session opened (a retry's found where it left off), rounds
        until the answer ends, each round's text, tokens and scores to `emit` once committed,
        then the session released, or unlocked where it is kept, whatever ended the call."""
        t_start = time.perf_counter()
        owner = uuid.uuid4().hex  # this call, as the holder of its session's lease
        req, opened, gen = await self._start(req, owner, deadline, t_start)
        handle = opened.handle
        flight = InFlight(list(opened.resumed))
        ok = False  # the answer is whole: a request id's session not kept is released
        metrics.ACTIVE_SESSIONS.inc()
        self.active += 1
        try:
            finish = await self._replay(gen, req, opened, emit)
            flight.reason, done = finish or flight.reason, finish is not None
            while not done and len(flight.generated) < req.max_new_tokens:
                done = await self._round(gen, req, flight, len(opened.resumed), emit)
            await flight.land()
            tail = gen.text.flush()
            if tail:
                await emit(tail, [], [] if gen.logprobs else None)
            ok = True
        finally:
            gen.closed = True
            if flight.release is not None:
                flight.release.set()
            metrics.ACTIVE_SESSIONS.dec()
            self.active -= 1
            # shielded: a second cancellation (the server's deadline firing while the loop
            # winds down) must not cut the release of the caches short
            closing = asyncio.ensure_future(self._close(handle, req, owner, flight.pending, gen.links, gen.late,
                                                        ok))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            await asyncio.shield(closing)
        metrics.TOKENS.inc(len(flight.generated) - len(opened.resumed))
        prompt = None if gen.prompt_scores is None else gen.prompt_scores.result(handle.committed,
                                                                                  handle.target_replica)
        return Outcome(handle.session_id, flight.generated, flight.reason, gen.stats, gen.prompt_len,
                       req.params.seed, handle.draft_replica, handle.target_replica,
                       (time.perf_counter() - t_start) * 1000, prompt)

    async def _start(self, req: GenerationRequest, owner: str, deadline: float | None,
                     t_start: float) -> tuple[GenerationRequest, Opened, Generation]:
        """→ (the request, its session, the loop's state): a retry of a request id takes its
        first attempt's seed, prompt scores and γ policy, so that it answers as that one would."""
        opened = await self._open(req, owner)
        handle = opened.handle
        if opened.retry and not opened.older:  # the first attempt's seed, drawn where the client gave none
            req = replace(req, params=replace(req.params, seed=int(handle.params.get("seed", req.params.seed))))
        gen = self._begin(req, handle, deadline, opened.start)
        if req.prompt_logprobs:
            self._score_prompt(gen, opened.start - len(req.prompt_ids), opened.start)
            if opened.retry:
                await self._stored_prompt_scores(gen, req, opened)
        if opened.retry and handle.policy and gen.keeps_policy:
            gen.policy = SessionPolicy.restore(handle.policy)
        gen.stats.started = t_start
        # not where a retry goes on from its first attempt's tokens: that attempt's first round
        # was its prefill, and a seeded sampled answer must reproduce round by round
        gen.prefill_round = self.first_round == "target" and gen.policy.fixed is None and not opened.resumed
        return req, opened, gen

    async def _round(self, gen: Generation, req: GenerationRequest, flight: InFlight, resumed: int,
                     emit: Emit) -> bool:
        """One round: draft (or take the pre-draft), verify, apply, and hand the commit and
        emit on to overlap the next round. → whether the answer has ended (its context full,
        an end token or a stop string)."""
        t_round, calls_before = time.perf_counter(), gen.stats.draft_ms + gen.stats.verify_ms
        active = self.active
        if gen.governed:
            mode = self.governor.speculating(gen.policy.greedy, active)
            gen.rounds_in_mode = gen.rounds_in_mode + 1 if mode == gen.speculating else 1
            gen.speculating = mode
        m = len(gen.handle.committed)
        if m >= self.max_len:
            flight.reason = "context"
            return True
        await self._probe_draft_pool(gen)
        remaining = req.max_new_tokens - len(flight.generated)
        pre = flight.pre
        if pre is not None:
            draft_tokens, dists, gamma, gen.runner_ups, gen.line = pre
            gen.looked_up = False
        else:
            draft_tokens, dists, gamma = await self._draft(gen, remaining, m)
        ahead = self.predraft.start(gen, draft_tokens, gamma, remaining, m)
        plain = pre is None and ahead is None and bool(flight.generated)  # own calls only, past the prefill
        if flight.release is not None:
            flight.release.set()  # the previous round's commit follows this verification out
        verdict = await self._verify_round(gen, draft_tokens, dists, ahead)
        # a first round's token streams before its pre-draft is waited for (below):
        # the draft's prefill of the prompt may outlast the target's
        early = ahead is not None and not gen.prefill_round
        flight.pre = await self.predraft.take(gen, ahead, verdict, gamma) if early else None
        new, out_text, flight.reason = self._apply(gen, m, gamma, draft_tokens, verdict)
        scores = self._scores(gen, verdict, len(new))
        flight.generated.extend(new)
        if flight.pending is not None:
            await flight.pending  # rounds are committed and streamed in order
        book = Round(gamma, verdict.accepted, tuple(verdict.keep_chances), len(new), active,
                     gen.speculating, gen.rounds_in_mode, time.perf_counter() - t_round,
                     gen.stats.draft_ms + gen.stats.verify_ms - calls_before, plain, tuple(gen.calls),
                     gen.looked_up)
        gen.calls.clear()
        flight.release, flight.pending = self._end_round(gen, book, new, out_text, scores, emit,
                                                         first=len(flight.generated) == resumed + len(new))
        if ahead is not None and not early:
            flight.pre = await self.predraft.take(gen, ahead, verdict, gamma)
            self._take_draft_holds(gen)
        gen.prefill_round = False
        return flight.reason in ("eos", "stop")

    def _begin(self, req: GenerationRequest, handle: SessionHandle, deadline: float | None,
               prompt_len: int) -> Generation:
        ends = Ends(frozenset() if req.ignore_eos else self.end_ids, req.stop_token_ids)
        # the law the replicas apply: the answer starts at prompt_len (what presence and
        # frequency penalties count) and cannot end before min_tokens (its end tokens banned)
        banned = tuple(sorted(ends.tokens)) if req.min_tokens else ()
        p = replace(req.params, penalty_start=prompt_len, banned_ids=banned,
                    banned_until=prompt_len + req.min_tokens if banned else 0)
        return Generation(
            handle, deadline, SessionLinks(self.pools, self.calls), Stats(),
            SessionPolicy(fixed=req.gamma, deterministic=req.seeded and p.temperature > 0, greedy=p.greedy),
            TextStream(self.tokenizer, req.stop, req.min_tokens), params_to_pb(p),
            0.0 if req.gamma is not None else self.stop_below[0 if p.greedy else 1],
            prompt_len, time.monotonic(), request_id=req.request_id, logprobs=req.logprobs,
            top_logprobs=req.top_logprobs, processed_logprobs=req.processed_logprobs, ends=ends,
            shapes=shapes(p), lookup=self.lookup_rates.policy(p.greedy), lookup_asked=req.lookup)

    @staticmethod
    def _score_prompt(gen: Generation, before: int, start: int) -> None:
        """Gather the prompt's log-probabilities from the target calls that feed it. A cache
        holds less than the committed tokens (specdec/rounds.py), so the target's holds none
        of the prompt, and the calls that feed it compute the rows that predict its tokens;
        `_rewind_for_scores` adds the row before each call's first token."""
        gen.prompt_scores = PromptScores(max(before, 1), start, gen.top_logprobs)

    async def _probe_draft_pool(self, gen: Generation) -> None:
        """A session decoding target-only for want of a draft replica looks for one again
        now and then: a draft may have come back."""
        if not gen.handle.draft_replica and time.monotonic() - gen.last_draft_probe > 1.0:
            gen.last_draft_probe = time.monotonic()
            gen.handle.draft_replica = await self.pools.pick(
                "draft", affinity=prefix_affinity(gen.handle.committed)) or ""
            gen.handle.cursor.draft_len = 0

    async def _draft(self, gen: Generation, remaining: int,
                     m: int) -> tuple[list[int], replica_pb2.DraftDistributions | None, int]:
        """This round's proposal → (draft tokens, their distributions or None, γ): the draft
        replica's, or prompt lookup's (`_look_up`, `_look_up_instead`: point masses, or none
        under greedy); prompt lookup's only in a call's first round under --first-round
        target, which then waits for no draft call (the draft's prefill and γ steps);
        γ = 0 (target-only) when the policy says so or neither can serve."""
        ready = gen.handle.draft_replica and gen.speculating and not gen.prefill_round and self.waits.ready(gen)
        gen.runner_ups, gen.line, gen.looked_up = None, None, False
        if not ready:
            draft = self._look_up(gen, remaining, m)
            return draft, self._lookup_law(gen, draft), len(draft)
        gamma = rounds.plan_gamma(gen.policy.choose(self.costs), remaining, m, self.max_len)
        if gen.policy.fixed is None and not gen.policy.probing:  # a probe measures the draft
            # where the policy drafts nothing, a lookup is priced against target-only
            lookup = self._look_up_instead(gen, gamma, remaining, m) if gamma else self._look_up(gen, remaining, m)
            if lookup:
                return lookup, self._lookup_law(gen, lookup), len(lookup)
        if gamma == 0:
            return [], None, 0
        # a long feed goes in chunks (`_feed_in_chunks`), a call each, and each call gets the wait
        chunks = self._chunk_calls(m - gen.handle.cursor.draft_len)
        if self.waits.wait_for(gen) is None:  # no task needed to wait the call out
            got = await self._propose(gen, gamma)
        else:
            got = await self.waits.in_time(gen, asyncio.ensure_future(self._propose(gen, gamma)), 1 + chunks)
        if got is None:
            return [], None, 0
        prop = got.response
        gen.stats.draft_ms += got.ms
        gen.calls.append(Call("draft", got.ms, None, prop, len(got.ref.tokens) <= 2, gamma))
        gen.runner_ups = list(prop.runner_ups) or None
        dists = prop.distributions if prop.HasField("distributions") else None
        return list(prop.draft_tokens), dists, len(prop.draft_tokens)  # the confidence stop may have cut it

    def _look_up(self, gen: Generation, remaining: int, m: int) -> list[int]:
        """A round that no draft replica drafts (none registered, its draft late, the load
        governor has turned drafting off, or the γ policy drafts nothing) drafts by prompt
        lookup, where the session may (`_may_look_up`) and the request leaves γ open (the
        session's LookupPolicy prices it) or fixes one above 0; → the draft, or []
        (target-only). Sets `gen.looked_up`; the caller takes γ from the draft's length."""
        policy = gen.policy
        if not self._may_look_up(gen):
            return []
        want = policy.fixed if policy.fixed is not None else gen.lookup.choose(self.costs, ngram.LOOKUP_GAMMA)
        gamma = rounds.plan_gamma(want, remaining, m, self.max_len)
        if gamma == 0:
            return []
        if gen.ngram is None:
            gen.ngram = ngram.NgramIndex()
        draft = gen.ngram.propose(gen.handle.committed, gamma)
        gen.looked_up = bool(draft)
        return draft

    def _may_look_up(self, gen: Generation) -> bool:
        """Greedy sessions look up unless lookups are off; sampled ones under `all` or where
        the request asks (prompt_lookup), unseeded (a seeded session's rounds must not hang
        on the load, which prices a lookup) and where the target replica registered its
        vocabulary, which the point masses span; a request fixing γ = 0 or saying
        prompt_lookup false never, nor any under `off`."""
        policy = gen.policy
        if self.lookup == "off" or policy.fixed == 0 or gen.lookup_asked is False:
            return False
        if policy.greedy:
            return True
        return ((gen.lookup_asked or self.lookup == "all") and not policy.deterministic
                and self.pools.vocab_size(gen.handle.target_replica) > 0)

    def _lookup_law(self, gen: Generation, draft: list[int]) -> replica_pb2.DraftDistributions | None:
        """A looked-up draft's law for the target: none under greedy (its verification
        compares with the argmaxes), else a point mass on each token."""
        if not draft or gen.policy.greedy:
            return None
        return to_pb(point_masses(draft, self.pools.vocab_size(gen.handle.target_replica)))

    def _look_up_instead(self, gen: Generation, gamma: int, remaining: int, m: int) -> list[int]:
        """An adaptive session (greedy, or sampled under `all`) whose draft replica would draft
        γ tokens looks them up instead where that is worth more tokens per millisecond: a
        lookup costs its round no draft call and no draft compute, so a likely one wins over
        a better draft (the bundled target's greedy answers repeat: a lookup kept at 0.88 a
        token beats its draft's 0.77 plus the draft's call). The draft's cache then lacks the
        round's tokens, and its next call feeds them. → the lookup, or [] (draft as planned)."""
        lookup = self._look_up(gen, remaining, m)
        if not lookup:
            return []
        drafted = gen.policy.expected_tokens(gamma) / self.costs.round_table(gamma)[gamma]
        if gen.lookup.tokens(len(lookup)) / self.costs.verify_table(len(lookup))[len(lookup)] > drafted:
            return lookup
        gen.looked_up = False
        return []

    async def _verify_round(self, gen: Generation, draft_tokens: list[int],
                            dists: replica_pb2.DraftDistributions | None, ahead: Ahead | None):
        """The round's verification; a pre-draft beside it is cancelled if it fails."""
        try:
            return await self._verify(gen, draft_tokens, dists)
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise

    def _apply(self, gen: Generation, m: int, gamma: int, draft_tokens: list[int],
               verdict) -> tuple[list[int], str | None, str]:
        """The verdict's tokens, cut after EOS or a stop token or where a stop string ends,
        committed to the handle → (the new tokens, their text or None, the finish reason so far). Only stop
        strings make the text decide the tokens; without them the text is decoded after the
        next round's call has left (`_finish_round`), and None is returned for it."""
        new = rounds.new_tokens(draft_tokens, verdict.accepted, verdict.next_token)
        new, reason = gen.ends.cut(new)
        reason = reason or "length"
        text = None
        if gen.text.stop:
            text, kept = gen.text.push(new)
            if gen.text.stopped:
                new, reason = new[:kept], "stop"
        handle = gen.handle
        handle.committed.extend(new)
        # a looked-up draft never reached the draft replica's cache: it stays where it was
        handle.cursor = rounds.advance(handle.cursor, m, 0 if gen.looked_up else gamma, verdict.accepted,
                                       verdict.cache_length, len(new))
        if gen.line is not None:  # this round's draft was a fork's: the draft's cache lacks it
            handle.cursor.draft_len = min(handle.cursor.draft_len, gen.line)
        self._take_draft_holds(gen)
        # a seeded session's policy counts its kept length, a function of its own tokens
        # only, so that the same request yields the same rounds; others learn from the
        # target's keep chances of a sampled draft (gamma_policy.keep_chances)
        gen.stats.observe(gamma, verdict.accepted)
        if gen.looked_up:
            gen.stats.looked_up += gamma
            chances = None if gen.policy.greedy else verdict.keep_chances
            gen.lookup.observe(gamma, verdict.accepted, chances)
            if not gen.policy.greedy:
                self.lookup_rates.observe(gamma, verdict.accepted, chances)
        else:  # the policy learns the draft replica's acceptance, not the lookup's
            gen.policy.observe(gamma, verdict.accepted, None if gen.policy.deterministic else verdict.keep_chances)
        if gen.keeps_policy:  # committed with the round, for a retry to go on from
            handle.policy = gen.policy.snapshot()
        if log.isEnabledFor(logging.DEBUG):  # a round's trace (--log-level DEBUG), for comparing two runs
            log.debug("session %s round at %d: γ %d (%s), kept %d, next %d; draft %s, target %s", handle.session_id,
                      m, gamma, draft_tokens, verdict.accepted, verdict.next_token, handle.draft_replica or "-",
                      handle.target_replica)
        return new, text, reason

    @staticmethod
    def _take_draft_holds(gen: Generation) -> None:
        """Where a pre-draft fed the draft's cache further than the round's cursor says
        (PreDrafter._take_main), the next proposal starts there, below the committed length."""
        if gen.draft_holds is not None:
            cursor = gen.handle.cursor
            cursor.draft_len = max(cursor.draft_len, min(gen.draft_holds, len(gen.handle.committed) - 1))
            gen.draft_holds = None

    @staticmethod
    def _scores(gen: Generation, verdict, kept: int) -> list[logprob_records.TokenLogprob] | None:
        """The log-probabilities of the round's first `kept` tokens (the rest were cut at
        EOS or a stop string), where the request asked for them."""
        if not gen.logprobs:
            return None
        top = gen.top_logprobs
        if len(verdict.logprobs) < kept or len(verdict.top_token_ids) < kept * top:
            raise PreconditionFailed(f"target replica {gen.handle.target_replica} returned no log-probabilities (a "
                                "version from before them?); retry without logprobs, or once the pool is upgraded")
        return logprob_records.records(verdict.logprobs[:kept], verdict.top_token_ids[:kept * top],
                                verdict.top_logprobs[:kept * top], top)

    def _end_round(self, gen: Generation, book: Round, new: list[int], text: str | None,
                   scores: list[logprob_records.TokenLogprob] | None, emit: Emit,
                   first: bool) -> tuple[asyncio.Event, asyncio.Future]:
        """→ (its release, its finish): the round's bookkeeping, Redis round trip and emit,
        which overlap the next round's verification (the first round's go at once, for the
        time to first token); its tokens reach the client only once they are committed.
        The commit is taken from the handle here: the next round's `_apply` may change the
        handle before the finish runs (tests/orchestrator/test_generation.py)."""
        release = asyncio.Event()
        if first:
            release.set()
        stored = None
        if scores is not None and gen.request_id:  # kept for a retry to send again (`_stored_scores`)
            offset = (gen.handle.length - len(new) - gen.prompt_len) * logprob_records.record_bytes(gen.top_logprobs)
            stored = AnswerScores(gen.prompt_len, offset, logprob_records.pack(scores, gen.top_logprobs))
        commit = self.store.round_commit(gen.handle, new, stored)
        return release, asyncio.ensure_future(self._finish_round(release, gen, book, commit, new, text, scores,
                                                                 emit))

    async def _finish_round(self, release: asyncio.Event, gen: Generation, book: Round, commit: RoundCommit,
                            new: list[int], text: str | None, scores: list[logprob_records.TokenLogprob] | None,
                            emit: Emit) -> None:
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
        round_book.record_round(self.costs, self.governor, gen, book)
        if text is None:
            text = gen.text.push(new)[0]
        stats = gen.stats
        t0 = time.perf_counter()
        prompt = gen.prompt_scores
        if gen.request_id and prompt is not None and prompt.complete and not prompt.stored:
            await self.store.save_prompt_scores(gen.handle.session_id, gen.prompt_len, prompt.packed())
            prompt.stored = True  # before the round's commit: a retry finding its tokens finds these
        if not await self.store.commit(commit):
            # the handle is gone (Redis lost it, or it was ended by an older orchestrator):
            # this call holds the whole session, so it writes it again rather than fail
            log.warning("session %s: its handle was gone at a round's commit; written again whole",
                        gen.handle.session_id)
            metrics.HANDLES_REWRITTEN.inc()
            await self.store.save(gen.handle)
        stats.redis_ms += (time.perf_counter() - t0) * 1000
        await emit(text, new, scores)
        if new and not stats.first_token_ms:
            stats.first_token_ms = (time.perf_counter() - stats.started) * 1000

    async def _close(self, handle: SessionHandle, req: GenerationRequest, owner: str,
                     pending: asyncio.Future | None = None, links: SessionLinks | None = None,
                     late: asyncio.Task | None = None, whole: bool = False) -> None:
        """Ephemeral sessions are released on both replicas and their handle deleted;
        kept sessions are unlocked for the next call. A round's commit still in flight
        (the loop ended by an error or a cancellation) lands first, so that it cannot
        recreate a handle deleted here. A draft call still late is left to end on its own
        (it keeps its replica marked stalled for the other sessions, `DraftWaits.in_time`), and a
        stalled replica is released in the background: the answer does not wait on a
        replica that has stopped answering."""
        draft_late = late is not None and not late.done() or self.waits.stalled(handle.draft_replica)
        if late is not None:
            self.waits.in_background(late)
        if pending is not None:
            await asyncio.wait([pending])
            if not pending.cancelled():
                pending.exception()  # already raised by the loop, or superseded by its error
        if links is not None:  # a generation's own streams ("stream" mode) close after their calls
            if draft_late:
                self.waits.in_background(asyncio.ensure_future(links.close()))
            else:
                await links.close()
        keep = req.keep_session or bool(req.session_id)
        if keep or req.request_id and not whole:  # a request id's cut answer: kept, caches and all, for its retry
            if not keep:  # its caches for the retry window, its handle longer (orchestrator/reaper.py)
                try:
                    await self.store.park(handle.session_id, self.retry_window)
                except Unavailable:
                    pass  # the caches go at the replicas' idle expiry
            await self.store.unlock(handle.session_id, owner)
            return
        await self.release(handle, draft_in_background=draft_late, keep_handle=bool(req.request_id))

    async def wind_down(self, timeout: float) -> int:
        """After the server's stop: wait up to `timeout` for the generations it cut short
        (those still running when a drain's grace ran out) to release their sessions, before
        the process closes its channels and Redis. Their ends run shielded from the
        cancellation, but once the process moved on they failed or never ran: every such
        session's handle was left in Redis until its TTL and its caches on both replicas
        until evicted. → how many were still releasing at the timeout."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:  # cancelled generations reach their ends
            await asyncio.sleep(0.01)
        ends = set(self._closing)
        if ends:
            await asyncio.wait(ends, timeout=max(0.0, deadline - time.monotonic()))
        return sum(not end.done() for end in ends)

    async def release(self, handle: SessionHandle, draft_in_background: bool = False,
                      keep_handle: bool = False, handle_ttl: int | None = None) -> None:
        """Release the session's caches on both replicas and delete its handle; or, with
        `keep_handle`, keep the handle with no replica, for `handle_ttl` seconds (default
        `retry_window`: a request id's whole answer, for a retry whose answer got lost; a cut
        one's for the session's TTL, and its retry builds the caches again)."""
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
                await asyncio.wait((draft,), timeout=self.waits.wait)
            if not draft.done():
                self.waits.in_background(draft)

        await asyncio.gather(release_draft(), release_on("target", handle.target_replica))
        try:
            if keep_handle:  # a copy: the call's stats still name the replicas it ran on
                kept = replace(handle, draft_replica="", target_replica="", cursor=rounds.Cursor())
                await self.store.save(kept, ttl=self.retry_window if handle_ttl is None else handle_ttl)
                await self.store.unlock(handle.session_id, handle.owner)
            else:
                await self.store.delete(handle.session_id, handle.answer_starts)
        except Unavailable:
            pass  # the handle expires by TTL
