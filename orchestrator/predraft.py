"""Overlapped drafting: while the target verifies round k, the draft already drafts round
k+1 on a prefix round k may end with (as in PEARL, Liu et al. 2025).

The main pre-draft assumes round k is accepted in full: it feeds the draft tokens the
draft's cache lacks, guesses the bonus token under the target's own noise for it
(sampling.bonus_guess_rows) and drafts on after it. It is kept only if the guess was the
bonus the target drew; the rest was drafted on exactly the committed prefix with the same
per-position randomness, so it is the draft round k+1 would have made, and the output law
is the target's. A fork (greedy, alone) feeds a likely correction of a rejected round
instead, the draft's runner-up, in a private copy of the draft's cache. Work drafted on a
prefix the verdict rejects is dropped.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

import grpc

from orchestrator.draft_waits import DraftWaits
from orchestrator.gamma_policy import CostModel
from orchestrator.loop_state import Generation
from specdec import metrics, rounds
from specdec.cache_ref import CacheRef
from specdec.encoding import drop_first_rows
from specdec.errors import DeadlineExceeded
from specdec.internal.v1 import replica_pb2
from specdec.wire_pb import from_pb, ref_to_pb, to_pb

OVERLAP_MIN_HIT = 0.25  # pre-draft when the estimated hit probability is at least this
OVERLAP_MIN_USE = 0.5  # under load, only while at least this share of a kind's pre-drafts were used
# greedy, alone: at most this many branch pre-drafts beside the main one. Off by default:
# on the 2-core CPU the draft's batch of forks outlasts the verification (benchmarks/HISTORY.md, "Forks")
OVERLAP_FORKS = 0
FORK_MIN_HIT = 0.03  # a branch is forked when its chance of use is at least this

# the next round's (draft tokens, their distributions or None, γ, runner-ups, line), as
# `Generator._round` takes a round's draft (`InFlight.pre`)
NextDraft = tuple[list[int], "replica_pb2.DraftDistributions | None", int, "list[int] | None", "int | None"]


@dataclass
class Ahead:
    """The pre-drafts running beside a round's verification: the main one (round accepted in
    full, bonus guessed) and forks by kept length j (runner-up at j + 1, its cache's base)."""
    main: asyncio.Task | None = None
    forks: dict[int, tuple[int, int, asyncio.Task]] = field(default_factory=dict)
    fed: int = 0  # the length of the committed tokens and the round's draft the main one feeds
    calls: int = 1  # the main one's calls: a long feed (a first round's prompt) goes in chunks
    first: bool = False  # the main one follows a first round the draft replica did not draft

    def tasks(self) -> list[asyncio.Task]:
        return ([self.main] if self.main else []) + [task for _, _, task in self.forks.values()]

    def cancel(self) -> None:
        for task in self.tasks():
            task.cancel()


class PreDrafter:
    """When to pre-draft, the calls that do it, and what a verdict keeps of them."""

    def __init__(self, costs: CostModel, waits: DraftWaits, timeout: Callable[[float | None], float],
                 max_len: int, calls: str, enabled: bool = True, min_hit: float = OVERLAP_MIN_HIT,
                 min_use: float = OVERLAP_MIN_USE, forks: int = OVERLAP_FORKS, max_feed: int = 0) -> None:
        self.costs = costs
        self.waits = waits
        self.timeout = timeout  # a call's timeout for a deadline (`Generator._timeout`)
        self.max_len = max_len
        self.calls = calls  # how Propose travels: round_stream.CALL_MODES
        self.enabled = enabled  # adaptive γ only
        self.min_hit = min_hit
        self.min_use = min_use  # under load (CostModel.predraft_pays)
        self.forks = forks  # greedy branch pre-drafts while alone
        self.max_feed = max_feed  # tokens a pre-draft's own call feeds at most, the rest in chunks (0: no limit)

    # ----------------------------------------------------------------- starting
    def start(self, gen: Generation, draft_tokens: list[int], gamma: int, remaining: int,
              m: int) -> Ahead | None:
        """Pre-draft round k+1 beside round k's verification, when that is likely to pay:
        the main pre-draft when the round is likely to be accepted in full with the bonus
        guessed right, forks (`_likely_forks`) on the likely rejections; otherwise it is
        draft work thrown away, which also slows the verification it runs beside on
        shared cores. A call's first round that the draft replica did not draft
        (--first-round target: the target's prefill alone, or a prompt lookup) pre-drafts
        the second: beside the target's prefill the draft prefills the prompt (in chunks,
        `_feed_chunks`, where it is long) and guesses the first token.

        Not for a seeded sampled session: the γ of a round drafted ahead is chosen a round
        earlier, before the verdict it follows is known, so whether a pre-draft is made and
        used moves where the session's rounds end, and with them its tokens, which must
        reproduce. And that turns on what no request controls: whether pre-drafts pay for
        the other sessions (`CostModel.predraft_pays`), or a draft replica failing while one
        runs (a pre-draft gets one attempt)."""
        policy = gen.policy
        drafted = gamma > 0 and not gen.looked_up  # by the draft replica
        if not (self.enabled and policy.fixed is None and not policy.deterministic
                and (drafted or gen.prefill_round)
                and gen.handle.draft_replica and gen.speculating and self.waits.ready(gen)):
            return None
        main, forks = self.wanted(gen, gamma)
        if not (main or forks):
            return None
        want = policy.choose(self.costs)  # one choice a round: choose counts the rounds it makes
        ahead = Ahead()
        # the draft's cache holds the committed tokens and the draft up to its last token,
        # or, after a fork, the committed tokens up to gen.line, or, in a first round it did
        # not draft, what its cursor says: feed what it lacks
        line = gen.handle.cursor.draft_len if not drafted else m + gamma - 1 if gen.line is None else gen.line
        seq = gen.handle.committed + draft_tokens
        ahead.fed, ahead.first = m + gamma, not drafted
        ahead.calls = 1 + rounds.chunk_calls(m + gamma - line, self.max_feed)
        g2 = rounds.plan_gamma(want, remaining - gamma - 1, m + gamma + 1, self.max_len) if main else 0
        if g2 > 0:
            ahead.main = asyncio.create_task(self._predraft(gen, line, seq[line:], g2 + 1))
            if ahead.first:
                metrics.OVERLAP.labels("first").inc()
        for j in forks:
            g = rounds.plan_gamma(want, remaining - j - 1, m + j + 1, self.max_len)
            if g > 0:
                base = min(line, m + j)
                feed = seq[base : m + j] + [gen.runner_ups[j]]
                task = asyncio.create_task(self._predraft(gen, base, feed, g, fork=True))
                ahead.forks[j] = (gen.runner_ups[j], base, task)
                metrics.OVERLAP.labels("fork").inc()
        return ahead if ahead.tasks() else None

    def wanted(self, gen: Generation, gamma: int) -> tuple[bool, list[int]]:
        """→ (whether to pre-draft the main line, the forks' kept lengths)."""
        policy = gen.policy
        if gen.looked_up:  # a first round's lookup (--first-round target) is kept at the lookup's rate
            hit = gen.lookup.rate ** gamma * policy.guess_rate
        else:
            hit = policy.predraft_hit(gamma)
        main = hit >= self.min_hit
        # a first round's pre-draft is exempt: even where its guess is wrong, the prompt it
        # fed is what the next proposal would feed (`_take_main`)
        if main and not gen.prefill_round and not self.costs.predraft_pays(policy.greedy, self.min_use):
            metrics.OVERLAP.labels("skipped").inc()
            main = False
        return main, self._likely_forks(gen, gamma)

    def forks_wanted(self, gen: Generation) -> bool:
        """Whether this session pre-drafts forks: greedy (a fork's guess is the draft's
        runner-up, the correction a greedy target most often makes), adaptive, and only
        while sessions have the target to themselves: alone, a fork costs draft time that
        would idle during the verification; under load it would cost other sessions."""
        policy = gen.policy
        return self.enabled and self.forks > 0 and policy.greedy and policy.fixed is None and self.costs.alone

    def _likely_forks(self, gen: Generation, gamma: int) -> list[int]:
        """The kept lengths j worth a fork, likeliest first: each fork feeds the draft's
        runner-up at position j + 1 (what the target would correct to) on the committed
        tokens and the first j draft tokens, and drafts the next round after it."""
        ups = gen.runner_ups
        if not (self.forks_wanted(gen) and ups and len(ups) >= gamma):
            return []
        chances = gen.policy.branch_chances(gamma)
        likely = sorted((j for j in range(gamma) if chances[j] >= FORK_MIN_HIT), key=lambda j: -chances[j])
        return likely[: self.forks]

    async def _predraft(self, gen: Generation, start: int, feed: list[int], num_tokens: int,
                        fork: bool = False) -> replica_pb2.ProposeResponse | None:
        """One pre-draft call (`fork` False: the main one), after the chunks of a long feed
        (`_feed_chunks`). One attempt; any failure just means no pre-draft."""
        handle = gen.handle
        try:
            if not fork:
                start, feed = await self._feed_chunks(gen, start, feed)
            request = replica_pb2.ProposeRequest(
                cache=ref_to_pb(CacheRef(handle.session_id, handle.epoch, start, feed)),
                num_tokens=num_tokens, sampling=gen.params_pb, guess_bonus=not fork, stop_below=gen.stop_below,
                runner_ups=self.forks_wanted(gen), fork=fork)
            resp = await gen.links.propose(handle.draft_replica, request, self.timeout(gen.deadline),
                                           ordered=not fork)
        except (grpc.aio.AioRpcError, DeadlineExceeded):
            return None
        gen.stats.wire_bytes += resp.ByteSize()
        return resp

    async def _feed_chunks(self, gen: Generation, start: int, feed: list[int]) -> tuple[int, list[int]]:
        """Feed the draft all but the last `max_feed` tokens of a long feed (a first round's
        prompt), a one-token proposal of `max_feed` tokens each, as `Generator._feed_in_chunks`
        feeds a replica: each of the draft's batched forwards then holds the other sessions
        in it for a chunk's share only. → what is left for the pre-draft's own call. Its
        cursor is not moved: a pre-draft that answers tells the loop what the draft holds
        (`gen.draft_holds`), and one that does not leaves the next proposal to feed anew."""
        handle, n = gen.handle, self.max_feed
        while n and len(feed) > n:
            request = replica_pb2.ProposeRequest(
                cache=ref_to_pb(CacheRef(handle.session_id, handle.epoch, start, feed[:n])), num_tokens=1,
                sampling=gen.params_pb)
            resp = await gen.links.propose(handle.draft_replica, request, self.timeout(gen.deadline))
            gen.stats.wire_bytes += resp.ByteSize()
            start, feed = start + n, feed[n:]
        return start, feed

    # ----------------------------------------------------------------- taking
    async def take(self, gen: Generation, ahead: Ahead, verdict, gamma: int) -> NextDraft | None:
        """→ the next round's draft from a pre-draft the verdict made right, or None. A
        wasted pre-draft on a stream is left to finish (it usually has: drafting is the
        shorter half of a round); the next call on that stream queues behind it, where
        cancelling would cost the stream."""
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
                self._observe(gen.policy.greedy, ahead, False)
            return await self._take_fork(gen, ahead, verdict)
        if kept is None:
            return None
        metrics.OVERLAP.labels("attempt").inc()
        return await self._take_main(gen, ahead, verdict)

    def _observe(self, greedy: bool, ahead: Ahead, used: bool) -> None:
        """A main pre-draft's fate joins its kind's use rate (`CostModel.predraft_pays`),
        a first round's aside: its pre-drafts are not gated by the rate (`wanted`)."""
        if not ahead.first:
            self.costs.observe_predraft(greedy, used)

    async def _take_fork(self, gen: Generation, ahead: Ahead, verdict) -> NextDraft | None:
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
        spec = await self.waits.in_time(gen, task)
        if spec is None or not spec.draft_tokens:
            return None
        metrics.OVERLAP.labels("fork_hit").inc()
        gen.stats.overlap_hits += 1
        return list(spec.draft_tokens), None, len(spec.draft_tokens), list(spec.runner_ups) or None, base

    async def _take_main(self, gen: Generation, ahead: Ahead, verdict) -> NextDraft | None:
        """The main pre-draft, kept only if its bonus token is the one the draft guessed.
        One that answered fed the draft's cache the round's whole draft, all of it kept:
        the next proposal need not feed it again (`gen.draft_holds`), which after a first
        round the draft did not draft is the whole prompt."""
        greedy, task = gen.policy.greedy, ahead.main
        spec = await self.waits.in_time(gen, task, ahead.calls)
        if gen.late is task:
            return None
        if spec is not None:
            gen.draft_holds = ahead.fed
        if spec is None or len(spec.draft_tokens) < 2:  # no draft after the guess
            self._observe(greedy, ahead, False)
            return None
        gen.policy.observe_guess(spec.draft_tokens[0] == verdict.next_token)
        self._observe(greedy, ahead, spec.draft_tokens[0] == verdict.next_token)
        if spec.draft_tokens[0] != verdict.next_token:
            return None
        metrics.OVERLAP.labels("hit").inc()
        if ahead.first:
            metrics.OVERLAP.labels("first_hit").inc()
        gen.stats.overlap_hits += 1
        # a greedy proposal has no distributions
        dists = to_pb(drop_first_rows(from_pb(spec.distributions), 1)) if spec.HasField("distributions") else None
        tokens = list(spec.draft_tokens[1:])
        return tokens, dists, len(tokens), list(spec.runner_ups[1:]) or None, None
