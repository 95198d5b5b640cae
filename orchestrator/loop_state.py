"""The records the speculate → verify → correct loop passes between its parts: the request,
what one generation carries from round to round, and what a round's bookkeeping takes
(orchestrator/round_book.py). Plain data: no gRPC, no Redis, no model."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from orchestrator.gamma_policy import SessionPolicy
from orchestrator.ngram import LookupPolicy, NgramIndex
from orchestrator.round_stream import SessionLinks
from orchestrator.text import TextStream
from specdec import logprob_records
from specdec.cache_ref import CacheRef
from specdec.errors import PreconditionFailed
from specdec.internal.v1 import replica_pb2
from specdec.logprob_records import TokenLogprob
from specdec.loop_stats import LoopStats
from specdec.rounds import Ends
from specdec.sampling_params import SamplingParams
from specdec.session_store import SessionHandle

if TYPE_CHECKING:  # predraft imports this module
    from orchestrator.predraft import NextDraft


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
    request_id: str = ""  # makes a retry continue the first attempt (orchestrator/request_ids.py)
    fingerprint: str = ""  # the request's fields but its id, hashed: a retry must match them
    logprobs: bool = False  # report the new tokens' log-probabilities under the target
    top_logprobs: int = 0  # and this many most likely tokens at each position
    prompt_logprobs: bool = False  # report the prompt tokens' log-probabilities too
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the answer besides EOS
    ignore_eos: bool = False  # EOS does not end the answer
    processed_logprobs: bool = False  # log-probabilities of the sampled law, not the raw one
    min_tokens: int = 0  # the answer's end tokens are banned before it has this many
    lookup: bool | None = None  # may draft by prompt lookup; None: as the server's --prompt-lookup says


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
    resumed: int = 0  # the answer's tokens earlier attempts of the same request_id committed
    looked_up: int = 0  # of `drafted`, the tokens prompt lookup proposed (orchestrator/ngram.py)


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
    prompt_logprobs: list[tuple[int, TokenLogprob]] | None = None  # (token, its record) per prompt token scored


# a chunk to the client: its text, its tokens, and their log-probabilities where asked (else None)
Emit = Callable[[str, list[int], list[TokenLogprob] | None], Awaitable[None]]


@dataclass
class Opened:
    """A session held by a call, its request's prompt appended (or found appended by an
    earlier attempt of the same request_id)."""
    handle: SessionHandle
    start: int  # where the request's answer begins in the committed tokens
    resumed: list[int] = field(default_factory=list)  # the answer earlier attempts committed
    retry: bool = False  # an earlier attempt of this request_id appended the prompt
    older: bool = False  # the session has gone on to another request since: the answer cannot grow


@dataclass
class Generation:
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
    request_id: str = ""  # the request's id (a retry of it goes on from what was committed)
    logprobs: bool = False  # each round's verification returns its tokens' log-probabilities
    top_logprobs: int = 0  # with this many alternatives each
    processed_logprobs: bool = False  # of the sampled law (every target call asks so)
    prompt_scores: "PromptScores | None" = None  # the prompt's log-probabilities, where asked
    ends: Ends = field(default_factory=Ends)  # the tokens that end this answer
    shapes: bool = False  # the law shapes the logits (specdec/shaping.py): its replies must say so
    runner_ups: list[int] | None = None  # the draft's runner-up at each of this round's draft positions
    # where this round's draft came from a fork: how far the draft replica's own cache still
    # holds the committed tokens (None: it holds the draft too, up to its last token)
    line: int | None = None
    looked_up: bool = False  # this round's draft came from prompt lookup (orchestrator/ngram.py), not a draft replica
    ngram: NgramIndex | None = None  # the session's prompt-lookup index, made at its first lookup
    lookup_asked: bool | None = None  # the request's prompt_lookup (None: unset)
    lookup: LookupPolicy = field(default_factory=LookupPolicy)  # its lookups' length (from ngram.LookupRates)
    speculating: bool = True  # this round's mode under load (orchestrator/governor.py)
    # this call's first round, which no draft replica drafts (--first-round target): its
    # first token streams after the target's prefill alone
    prefill_round: bool = False
    rounds_in_mode: int = 0  # rounds in a row in that mode, this one included
    # how much of the committed tokens and this round's draft a pre-draft that answered fed
    # the draft replica's cache (PreDrafter._take_main); the round's cursor takes it in
    draft_holds: int | None = None
    calls: list["Call"] = field(default_factory=list)  # this round's answered calls, for its bookkeeping
    # a draft call the loop stopped waiting for (`DraftWaits.in_time`): until it ends the
    # session makes no other, and its rounds are target-only
    late: asyncio.Task | None = None
    closed: bool = False  # the loop has ended: a late call left running sends nothing more

    @property
    def keeps_policy(self) -> bool:
        """Whether the γ policy's state is committed with each round, for a retry to go on
        from: a request with an id whose tokens the γs it chooses decide, an adaptive seeded
        sampled one (greedy tokens do not depend on γ, and a fixed γ is the request's)."""
        return bool(self.request_id) and self.policy.fixed is None and self.policy.deterministic

    @property
    def governed(self) -> bool:
        """Whether the load governor may turn this generation's speculation off: adaptive
        γ only, and not a seeded sampled request (its policy is deterministic)."""
        return self.policy.fixed is None and not self.policy.deterministic


@dataclass
class PromptScores:
    """A request's prompt tokens' log-probabilities, gathered from the target calls that feed
    them (a prompt's chunks, then the first round's verification): the fed tokens' after the
    first of each call come from the rows that predict them (VerifyRequest.fed_logprobs).
    Positions [first, end) of the session: the prompt's, but a new session's first token,
    which nothing predicts. A cache rebuilt on another replica feeds them again: the last
    answer for a position stands."""
    first: int
    end: int
    top: int
    got: dict[int, TokenLogprob] = field(default_factory=dict)
    stored: bool = False  # in Redis for a retry (a request with an id), or read from there

    @property
    def complete(self) -> bool:
        return len(self.got) >= self.end - self.first

    def packed(self) -> bytes:
        """The records in position order, as stored (logprob_records.pack)."""
        return logprob_records.pack([self.got[p] for p in range(self.first, self.end)], self.top)

    def restore(self, data: bytes) -> bool:
        """Take them from what an earlier attempt stored → whether it was all there."""
        records = logprob_records.unpack(data, self.top, self.end - self.first)
        if records is None:
            return False
        self.got, self.stored = dict(zip(range(self.first, self.end), records)), True
        return True

    def wants(self, start: int, fed: int) -> bool:
        """Whether a call feeding `fed` tokens from position `start` scores any still missing."""
        return fed > 1 and not self.complete and start + 1 < self.end and start + fed > self.first

    def missing(self, position: int) -> bool:
        return self.first <= position < self.end and position not in self.got

    def note(self, start: int, resp: replica_pb2.VerifyResponse) -> None:
        records = logprob_records.records(resp.fed_logprobs, resp.fed_top_token_ids, resp.fed_top_logprobs, self.top)
        for k, record in enumerate(records):
            if self.first <= start + 1 + k < self.end:
                self.got[start + 1 + k] = record

    def result(self, committed: list[int], replica: str) -> list[tuple[int, TokenLogprob]]:
        """(token, record) per prompt position; PreconditionFailed where a target replica
        from before fed log-probabilities left some out."""
        if not self.complete:
            raise PreconditionFailed(f"target replica {replica} returned no prompt log-probabilities (a version "
                                     "from before them?); retry without prompt_logprobs, or once the pool is upgraded")
        return [(committed[p], self.got[p]) for p in range(self.first, self.end)]


@dataclass(frozen=True)
class Proposal:
    """A draft replica's answer to a proposal, with what was asked and how long it took."""
    response: replica_pb2.ProposeResponse
    ref: CacheRef  # the cache positions and tokens the call fed
    ms: float


@dataclass(frozen=True)
class Call:
    """An answered internal call, as the round's bookkeeping (round_book.note_call) needs it."""
    pool: str  # "draft" or "target"
    ms: float  # its wall time
    request: object | None  # the message sent, where its size counts on the wire
    response: object
    steady: bool  # fed at most two tokens: a measure of a round's call (a prefill is not)
    tokens: int  # γ asked for (draft), or drafted tokens verified (target)


@dataclass(frozen=True)
class Round:
    """What a round's bookkeeping needs (round_book.record_round), taken as the round ends."""
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
    calls: tuple[Call, ...]
    looked_up: bool = False  # its draft came from prompt lookup: no draft's acceptance to learn from


@dataclass
class InFlight:
    """What one round hands the next besides the generation: the answer so far, why it would
    end now, a pre-draft of the next round, and the previous round's commit, which overlaps
    the next round's verification (`Generator._end_round`)."""
    generated: list[int]  # the answer's tokens, a retry's committed ones first
    reason: str = "length"  # why the answer ends, were it to end now
    pre: NextDraft | None = None  # the next round's draft, made while the previous round was verified
    pending: asyncio.Future | None = None  # the previous round's commit, then its emit
    release: asyncio.Event | None = None  # lets that commit go (`Generator._finish_round`)

    async def land(self) -> None:
        """Lets the last round's commit go and waits for it and its emit."""
        if self.pending is not None:
            self.release.set()
            await self.pending
