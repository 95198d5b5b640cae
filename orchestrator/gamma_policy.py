"""Adaptive speculation length.

Per session, the rate at which each draft position is kept is estimated online; per
process, the cost of a draft step and of a verification are measured from the rounds
themselves. γ maximises expected tokens per unit of time,

    E(γ) / (D(γ) + V(γ)),  E(γ) = 1 + Σ_{i ≤ γ} Π_{j ≤ i} c_j,

with c_j the chance that position j is kept once position j − 1 is, D(γ) the draft call's
time and V(γ) the verify call's, both measured on the rounds themselves (prefill rounds
excluded); while sessions are alone V(γ) also carries the round's time outside its calls,
paid once a round whatever γ is (`CostModel.observe_round_overhead`). With one rate α at
every position E(γ) = (1 − α^(γ+1)) / (1 − α), the model of the token rule; under the
target's default block rule later positions are kept more often than one α says, which
the per-position rates carry (`PositionRates`). Each
sampled round teaches every position up to its γ at once: the target returns, per
position, the rule's chance that a prefix that long is kept (`keep_chances`), unbiased for
what drafting that many tokens keeps and less noisy than the one kept length the round
yields.

While the replicas serve one session per batch, D(γ) and V(γ) are simply the measured
wall times of calls with that γ, once it has been run often enough. Elsewhere a linear
model (a fixed part per call plus a part per token, split by the compute time the
replicas report) fills in, scaled by how far off it is where both are known, so that the
two sources agree. The linear model overstates the marginal token on a CPU, where going
from one row to two changes the matrix kernel and later rows cost little
(benchmarks/RESULTS.md, step costs), so each session now and then runs one γ above or
below its best: the measured table then grows around the optimum and the choice climbs
to it.

A measured time speaks for the present only while it is fresh: an entry not updated in the
last `FRESH_CALLS` calls of its kind served alone is set aside (and restarts when that γ
runs again), and the model, scaled to the fresh entries, fills in. Otherwise an entry
from an earlier spell — other texts, another sampling kind, the machine at another speed
— stands beside one measured just now: after greedy rounds (whose calls carry no
distributions and cost less), the γ = 3 entry of a t = 1 session still held greedy times
while γ = 4 had just been measured at t = 1, 18.8 against 22.9 ms a round where the true
difference was 1.5–2 ms, and the choice sat at γ ≤ 3 (a trace of the policy through a
local stack, 2026-12-01).

In a shared batch, though, a session's own γ barely changes its own wall time (it waits
for the batch), while every session's γ together sets the batch's cost: the measured
table would call extra tokens free and push every γ up (measured at 16 streams: mean γ
6.1, and slower than target-only decoding). Under load the batch's forward decides: the
verify time of a round is the call's time outside the forward plus the forward of a batch
whose B sessions all feed γ + 1 rows, read off the target's cost curve by rows, measured
from every response (orchestrator/forward_costs.py), with the draft's time from the linear
model; until that curve has two points, the linear model with a fixed per-token slope, and
above its last point no more than that model says (so rows never run are tried, then
measured).
More sessions make each token cost B rows, so γ shrinks as the target saturates and
reaches 0 (no speculation) when drafting no longer pays, and grows again as load falls.
The fixed slope, taken on another CPU, priced a token at 1.8 ms in a batch of 4 where
this one's forward adds 0.35 (`make bench`, 19:53 UTC); by turns on one stack (`ab_probe
--runs t1:4:e,...`, three runs of three rounds, 2026-12-01 20:44-20:58 UTC) the measured
curve chose γ 3.0-4.3 against 2.7-3.0 at t = 1 and 4 streams and was 4.7, 7.7 and 3.5 %
faster there; at 16 streams it was 3.3, 6.7 and 0.5 % slower at t = 1 (the draft's work
shares the two cores with the target on this machine) and 3.9 % slower and 0.2 % faster
greedy.
At γ = 0 one choice in `ZERO_PROBE_EVERY` probes with a short draft so that α and the
draft's costs stay current: counted over all sessions of the sampling kind, not per session,
or a workload of short answers (a few rounds each) would never probe, and once priced out
would stay so whatever the load did next (a test's 3-token calls under four callers:
7 used pre-drafts in 9,600 calls, 2026-12-07).

A session's own α rests on a few dozen draft tokens, so it is noisy (about ±0.09 after
ten rounds at α 0.7), and where speculation pays only a little — temperature 1 on this
pair — a low draw tips the choice to γ = 0, where the estimate stops moving until the
next probe (measured: unseeded one-stream runs at t = 1 averaged γ 1.0–1.7, slower than
a fixed γ = 4). So the estimate is shrunk towards the rate of all recent sessions of the
same sampling kind (greedy or sampled) in this process, weighted as `POOL_WEIGHT` draft
tokens: a session's own evidence still dominates once it has some. The kind's rates give
the shape by position, the session's rounds the level: its rates are the kind's, scaled
by what it kept against what the kind's rates predict for its own rounds.

Reproducibility: which token a seeded sample yields depends on where round boundaries
fall, so a request that fixes its seed at temperature > 0 gets a *deterministic* policy:
its own α estimate (from its kept lengths alone, a function of its own tokens; one rate
at every position) against the fixed reference costs below instead of the measured,
load-dependent ones. Its output law is the target's
either way; this only makes the same seeded request give the same tokens.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from orchestrator.forward_costs import ForwardCosts

MAX_GAMMA = 8
# Extra forward cost per verified draft token, as a fraction of a plain decode step of the
# same batch, for the linear model that prices γ until the measured forward curve can:
# on the bundled pair (benchmarks/RESULTS.md, step costs, 2026-11-30 22:37 UTC)
# verifying γ = 4 costs 1.59 steps at batch 1, 1.48 at batch 4 and 1.99 at batch 16, i.e.
# about 0.15 per token plus 0.007 per extra session in the batch: a fuller batch leaves
# less idle compute to verify with.
VERIFY_TOKEN_SLOPE = 0.15
VERIFY_TOKEN_SLOPE_PER_SESSION = 0.007


def verify_slope(batch_size: int) -> float:
    return VERIFY_TOKEN_SLOPE + VERIFY_TOKEN_SLOPE_PER_SESSION * max(0, batch_size - 1)


# a choice takes the shortest γ whose expected tokens per ms are within this share of the
# best's (`shortest_near_best`)
NEAR_BEST = 0.03
EXPLORE_EVERY = 8  # every 8th adaptive round of a session tries a neighbour of its best γ
PLAIN_EVERY = 3  # and every 3rd of those below it tries γ = 0 (one round in 48 a plain one)
MEASURED_AFTER = 4  # calls with a given γ before their measured time replaces the model
FRESH_CALLS = 100  # a measured γ not run for this many calls (served alone) is stale
ALONE_BELOW = 1.5  # mean sessions per verify batch under which the measured times are used
POOL_WEIGHT = 8.0  # draft tokens' worth of weight the process-wide α has in a session's estimate
POOL_AFTER = 20  # rounds of a sampling kind before its process-wide α is used
PREDRAFT_USE_AFTER = 8  # loaded pre-drafts of a kind before their use rate can stop them
PREDRAFT_PROBE_EVERY = 8  # while stopped, every 8th chance still pre-drafts, to keep the rate current
ZERO_PROBE_EVERY = 16  # while priced out, every 16th choice of γ = 0 drafts γ = 2 instead
# calls observed after which the round times a choice reads are recomputed: pricing every γ
# took 100 µs a choice under load, for costs whose decayed means move by a few percent in
# that many calls
TABLE_REFRESH = 8


@dataclass
class Ema:
    value: float | None = None
    weight: float = 0.1
    count: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x
        self.count += 1

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass
class GammaTable:
    """Measured wall times of whole calls, per γ, while sessions are alone; each entry
    dated by the table's own clock (its calls), so that a stale one can be told apart."""
    entries: dict[int, Ema] = field(default_factory=dict)
    updated: dict[int, int] = field(default_factory=dict)  # γ → the clock at its last update
    clock: int = 0

    def _fresh(self, gamma: int) -> bool:
        return gamma in self.entries and self.clock - self.updated[gamma] <= FRESH_CALLS

    def update(self, gamma: int, ms: float) -> None:
        self.clock += 1
        if not self._fresh(gamma):
            self.entries[gamma] = Ema()  # a stale entry starts over
        self.entries[gamma].update(ms)
        self.updated[gamma] = self.clock

    def measured(self, gamma: int) -> float | None:
        if not self._fresh(gamma) or self.entries[gamma].count < MEASURED_AFTER:
            return None
        return self.entries[gamma].value

    def __iter__(self):
        return iter(self.entries)


def keep_chances(gamma: int, accepted: int, chances: Sequence[float] | None) -> list[float]:
    """A round's chance, per draft position i = 1..γ, that a prefix of i tokens is kept: the
    target's figures for a sampled draft (specdec.sampling.token_keep_chances_row, or the
    block weights), unbiased for what drafting i tokens keeps and less noisy than the kept
    length alone; else (greedy, where they are exact, or a replica that sends none) the
    kept length as 1s and 0s."""
    if chances is not None and len(chances) == gamma:
        return [float(c) for c in chances]
    return [1.0 if i < accepted else 0.0 for i in range(gamma)]


def reached_chances(chances: Sequence[float]) -> list[float]:
    """The chance that each position 1..γ is reached (prefix i − 1 kept): its trial."""
    return [1.0, *chances[:-1]]


def expected_by_gamma(rates: Sequence[float]) -> list[float]:
    """Tokens a round for γ = 0 .. len(rates), with c_i the chance that position i is kept
    once position i − 1 is: 1 + Σ_{i ≤ γ} Π_{j ≤ i} c_j. A constant rate α gives
    (1 − α^(γ+1)) / (1 − α)."""
    out, kept = [1.0], 1.0
    for rate in rates:
        kept *= rate
        out.append(out[-1] + kept)
    return out


@dataclass
class PositionRates:
    """Decayed means, per draft position i, over the rounds that drafted it, of the chance
    that prefix i is kept (`kept`) and that prefix i − 1 is (`reached`): their ratio is the
    position's rate c_i. Under the token rule with a constant α every c_i is α; under the
    block rule a long draft keeps more than that — its later positions' rates are higher
    (measured at t = 1 on the bundled pair: expected tokens a round +6.7 % at γ = 4 and
    +16.5 % at γ = 8 over the token rule on the same drafts) — so one α fitted to a
    session's rounds mis-states other γs, and the choice erred short."""
    kept: list[Ema] = field(default_factory=list)
    reached: list[Ema] = field(default_factory=list)

    def update(self, chances: Sequence[float]) -> None:
        while len(self.kept) < len(chances):
            self.kept.append(Ema(weight=0.02))
            self.reached.append(Ema(weight=0.02))
        for i, (chance, reached) in enumerate(zip(chances, reached_chances(chances))):
            self.kept[i].update(chance)
            self.reached[i].update(reached)

    def rates(self, n: int) -> list[float]:
        """c_1..c_n; a position with fewer than `POOL_AFTER` rounds takes its predecessor's
        rate (the first, 0.75: the sessions' prior)."""
        out, rate = [], 0.75
        for i in range(n):
            if i < len(self.kept) and self.kept[i].count >= POOL_AFTER and self.reached[i].value > 0:
                rate = min(1.0, self.kept[i].value / self.reached[i].value)
            out.append(rate)
        return out


@dataclass
class CostModel:
    """Shared by all sessions of one orchestrator process."""
    draft_call: Ema = field(default_factory=Ema)  # ms of a draft call, fixed part
    draft_step: Ema = field(default_factory=Ema)  # ms per drafted token
    verify_base: Ema = field(default_factory=Ema)  # ms of a verify call with no draft
    verify_token: Ema = field(default_factory=Ema)  # extra ms per draft token verified
    batch: Ema = field(default_factory=Ema)  # sessions per verify batch
    draft_by_gamma: GammaTable = field(default_factory=GammaTable)  # ms of a whole draft call, per γ
    verify_by_gamma: GammaTable = field(default_factory=GammaTable)  # ms of a whole verify call, per γ
    pool_accepted: dict[bool, Ema] = field(default_factory=dict)  # per round, keyed by greedy
    pool_tried: dict[bool, Ema] = field(default_factory=dict)
    pool_positions: dict[bool, "PositionRates"] = field(default_factory=dict)  # keyed by greedy
    forward: ForwardCosts = field(default_factory=ForwardCosts)  # the target forward's ms by its rows
    verify_wait: Ema = field(default_factory=Ema)  # ms of a verify call outside its batch's forward
    round_overhead: Ema = field(default_factory=Ema)  # ms of a round outside its calls, while alone
    predraft_use: dict[bool, Ema] = field(default_factory=dict)  # under load: share of pre-drafts used, by greedy
    predraft_skipped: dict[bool, int] = field(default_factory=dict)
    zero_choices: dict[bool, int] = field(default_factory=dict)  # γ = 0 choices, by greedy (`zero_probe`)
    observed: int = 0  # draft and verify calls observed
    # "round" or "verify" → (its ms by γ, `observed` when computed, `alone` then)
    _tables: dict[str, tuple[list[float], int, bool]] = field(default_factory=dict)

    def observe_acceptance(self, greedy: bool, gamma: int, accepted: int,
                           chances: Sequence[float] | None = None) -> None:
        """One speculative round of some session: the process-wide α of its sampling kind,
        and its rate at each draft position (`keep_chances`)."""
        if gamma > 0:
            chances = keep_chances(gamma, accepted, chances)
            self.pool_accepted.setdefault(greedy, Ema(weight=0.02)).update(sum(chances))
            self.pool_tried.setdefault(greedy, Ema(weight=0.02)).update(sum(reached_chances(chances)))
            self.pool_positions.setdefault(greedy, PositionRates()).update(chances)

    def pool_rates(self, greedy: bool, n: int) -> list[float] | None:
        """The kind's rates at draft positions 1..n (`PositionRates.rates`), or None until
        it has enough rounds."""
        positions = self.pool_positions.get(greedy)
        return None if positions is None or self.pool_alpha(greedy) is None else positions.rates(n)

    def observe_predraft(self, greedy: bool, used: bool) -> None:
        """A pre-draft's fate, counted while sessions share the target's batches."""
        if not self.alone:
            self.predraft_use.setdefault(greedy, Ema(weight=0.05)).update(float(used))

    def predraft_pays(self, greedy: bool, min_use: float) -> bool:
        """Whether pre-drafting still pays for this sampling kind. Alone, a wasted pre-draft
        costs only draft time that would have idled; under load it costs the draft pool
        capacity other sessions wait for (and, where the pools share cores, the target's
        time), so the kind's pre-drafts must be used at least `min_use` of the time. The
        hit estimate that starts one (α^γ × guess rate) is a session's; this is what its
        kind's pre-drafts actually did. Measured on the bundled pair under load: greedy
        used 52-66 % of them, t = 1 20-41 % (`benchmarks.stack_probe`), and turning
        pre-drafts off under load made greedy 3-10 % slower and t = 1 5-7 % faster
        (`ab_probe`, 2026-12-01 19:13-19:20 UTC); with this rule against none, by turns
        (21:36-21:38 UTC), within the noise (benchmarks/HISTORY.md, "Overlapped drafting"). While stopped, every
        `PREDRAFT_PROBE_EVERY`th chance still pre-drafts, so the rate follows the text."""
        use = self.predraft_use.get(greedy)
        if self.alone or min_use <= 0 or use is None or use.count < PREDRAFT_USE_AFTER or use.value >= min_use:
            return True
        self.predraft_skipped[greedy] = self.predraft_skipped.get(greedy, 0) + 1
        return self.predraft_skipped[greedy] % PREDRAFT_PROBE_EVERY == 0

    def zero_probe(self, greedy: bool) -> bool:
        """A choice of γ = 0 by an unseeded session: whether it probes instead, every
        `ZERO_PROBE_EVERY`th over the process's sessions of its kind."""
        self.zero_choices[greedy] = self.zero_choices.get(greedy, 0) + 1
        return self.zero_choices[greedy] % ZERO_PROBE_EVERY == 0

    def pool_alpha(self, greedy: bool) -> float | None:
        accepted, tried = self.pool_accepted.get(greedy), self.pool_tried.get(greedy)
        if accepted is None or accepted.count < POOL_AFTER or not tried.value:
            return None
        return accepted.value / tried.value

    def observe_draft(self, gamma: int, ms: float, compute_ms: float, batch_size: int = 1) -> None:
        """A draft call of γ tokens took `ms` here, `compute_ms` of it in the replica's engine,
        in a batch of `batch_size` sessions.

        The engine's time is per-token work (γ forward steps and samples); the rest, the
        network and both ends' gRPC, is paid once per call whatever γ is. Only calls served
        alone while the sessions are alone on average (`alone`) enter the per-γ table, which
        speaks for that case (`round_ms`): times taken under load, the tail of a loaded spell
        included, would stay in it after the load is gone and hold γ down (measured before
        this rule: one stream right after 16 drafted γ 0.40 on average, at 126 tokens/s
        against 200 before the load)."""
        if gamma <= 0:
            return
        self.observed += 1
        if not 0 < compute_ms <= ms:  # a replica that reports no compute time: a rough split
            compute_ms = 0.7 * ms
        self.draft_step.update(compute_ms / gamma)
        self.draft_call.update(ms - compute_ms)
        if batch_size <= 1 and self.alone:
            self.draft_by_gamma.update(gamma, ms)

    def observe_verify(self, gamma: int, ms: float, batch_size: int, compute_ms: float,
                       batch_tokens: int = 0) -> None:
        """A verify call with γ draft tokens took `ms`, `compute_ms` of it in the engine (the
        whole batch's forward, which this session waits for). The forward's cost grows with
        every token verified (`verify_slope` of a step per token, more in fuller batches);
        under load the batch's forward grows, and with it the per-token cost, which is what
        shrinks γ as the target saturates. The batch's forward (compute time and rows) also
        joins the measured curve that prices γ under load once it can (`_loaded_verify`)."""
        self.observed += 1
        self.batch.update(float(batch_size))
        if 0 < compute_ms <= ms:
            self.forward.observe(batch_tokens, compute_ms)
            self.verify_wait.update(ms - compute_ms)
        else:
            compute_ms = 0.8 * ms
        slope = verify_slope(batch_size)
        step = compute_ms / (1 + slope * gamma)
        self.verify_base.update(ms - compute_ms + step)
        self.verify_token.update(slope * step)
        if batch_size <= 1 and self.alone:  # as for the draft: the table speaks for sessions alone
            self.verify_by_gamma.update(gamma, ms)

    def observe_round_overhead(self, ms: float, calls_ms: float) -> None:
        """A round's wall time outside its draft and verify calls: the loop's own work and
        the wait for the previous round's commit. Paid once a round whatever γ is, so a
        table of call times alone prices a round of one token too cheaply: at t = 1 and one
        stream the choice tipped to γ = 0 on a 1 % margin in 15 % of the rounds, where a
        round cost 0.3-0.6 ms beyond its calls (`make bench`, 2026-12-02 16:03 UTC).
        Only while alone: under load a session's own overhead overlaps the others' work.
        A round that spent longer outside its calls than in them stalled (a slow Redis, a
        pause): not the loop's cost, and it would lift every γ alike for many rounds."""
        if self.alone and 0 <= ms <= calls_ms:
            self.round_overhead.update(ms)

    @property
    def alone(self) -> bool:
        """Sessions have the target's batches to themselves (no load)."""
        return self.batch.get(1.0) < ALONE_BELOW

    def _model_verify(self, gamma: int) -> float:
        return self.verify_base.get(10.0) + gamma * self.verify_token.get(0.5)

    def _loaded_verify(self, gamma: int) -> float:
        """Under load: the call's time outside the forward, plus the forward of a batch
        whose sessions all feed γ + 1 rows (the pending token and the draft), read off the
        measured curve (orchestrator/forward_costs.py); the linear model until the curve
        has two points.

        Above the curve's last point its rise is a guess, and a steep one where the points
        are few and low: after target-only rounds of two sessions the points sat at 1-3
        rows, rows 1 → 2 (the CPU kernel's jump, 6.7 → 11.7 ms) set the slope of every row
        after, γ = 4 was priced at about 30 ms a round against 12 for γ = 0, and
        speculation stayed off for a whole short run (CI of 2438010, the stack_probe smoke
        test; the points read from the orchestrator's /metrics after `stack_probe
        --configs greedy:2 --systems f`, 2026-12-02).
        There a γ is priced at no more than the linear model says, and no less than the
        curve's last point: optimistic where nothing is measured, so the rows get run and
        measured, and the curve then decides."""
        rows = self.batch.get(1.0) * (gamma + 1)
        forward = self.forward.ms(rows)
        if forward is None:
            return self._model_verify(gamma)
        wait = self.verify_wait.get(1.0)
        top_rows, top_ms = self.forward.top()  # the curve has points: `ms` gave a time
        if rows <= top_rows:
            return wait + forward
        return max(wait + top_ms, min(wait + forward, self._model_verify(gamma)))

    def _model_draft(self, gamma: int) -> float:
        return self.draft_call.get(0.5) + gamma * self.draft_step.get(1.0)

    def _calibrated(self, table: GammaTable, model, gamma: int) -> float:
        """The measured time for γ, or the model's scaled by how far it is off where both
        are known: a table filled at some γ and a model elsewhere must not disagree by
        construction, or the choice drifts towards wherever the model is optimistic."""
        value = table.measured(gamma)
        if value is not None:
            return value
        ratios = [m / model(g) for g in table if (m := table.measured(g)) is not None and model(g) > 0]
        return model(gamma) * (sum(ratios) / len(ratios) if ratios else 1.0)

    def round_ms(self, gamma: int) -> float:
        if not self.alone:
            verify, draft = self._loaded_verify(gamma), self._model_draft(gamma)
        else:
            verify = self._calibrated(self.verify_by_gamma, self._model_verify, gamma)
            verify += self.round_overhead.get(0.0)
            draft = self._calibrated(self.draft_by_gamma, self._model_draft, gamma)
        return verify if gamma == 0 else draft + verify

    def verify_round_ms(self, gamma: int) -> float:
        """`round_ms` of a round with no draft call (a prompt lookup's, orchestrator/ngram.py):
        its verification, and while alone the loop's own overhead."""
        if not self.alone:
            return self._loaded_verify(gamma)
        return self._calibrated(self.verify_by_gamma, self._model_verify, gamma) + self.round_overhead.get(0.0)

    def round_table(self, max_gamma: int) -> list[float]:
        """`round_ms` of γ = 0 .. max_gamma (at least), as a choice reads them: recomputed
        once `TABLE_REFRESH` calls have been observed since, or when the load regime
        (`alone`) flips, not on every choice of every session."""
        return self._priced("round", self.round_ms, max_gamma)

    def verify_table(self, max_gamma: int) -> list[float]:
        """`verify_round_ms` of γ = 0 .. max_gamma (at least), kept as `round_table` is: a
        prompt lookup's choice read every γ's price on every round of every session that may
        look up, 56 µs a choice under load (the forward curve sorted twice a γ)."""
        return self._priced("verify", self.verify_round_ms, max_gamma)

    def _priced(self, name: str, price: Callable[[int], float], max_gamma: int) -> list[float]:
        alone = self.alone
        table, at, was_alone = self._tables.get(name, ((), 0, alone))
        if len(table) <= max_gamma or alone != was_alone or self.observed - at >= TABLE_REFRESH:
            table = [price(g) for g in range(max(max_gamma, MAX_GAMMA) + 1)]
            self._tables[name] = (table, self.observed, alone)
        return table


REFERENCE = None  # set below: the cost model a deterministic policy uses


@dataclass
class SessionPolicy:
    fixed: int | None = None  # num_speculative_tokens from the request
    accepted: float = 3.0  # Beta(3, 1) prior: optimistic until measured
    trials: float = 4.0
    # per draft position, the decayed chance mass that reached it (Σ = trials; the prior's at 1)
    reached: list[float] | None = None
    rounds_at_zero: int = 0  # a seeded session's γ = 0 choices in a row (unseeded: `CostModel.zero_probe`)
    rounds: int = 0
    max_gamma: int = MAX_GAMMA
    deterministic: bool = False  # seeded sampling: ignore measured costs
    guessed: float = 2.0  # Beta(2, 1) prior of the pre-draft's bonus guess being right
    guesses: float = 3.0
    # a rejection corrected to the draft's runner-up: 0.33 teacher-forced on the bundled pair's
    # held-out windows, so a prior of Beta(1, 2)
    runner_up_right: float = 1.0
    runner_up_tries: float = 3.0
    greedy: bool = False  # the sampling kind, whose process-wide α the estimate leans on
    estimate: list[float] | None = None  # the per-position rates of the last choice

    def __post_init__(self) -> None:
        if self.reached is None:
            self.reached = [self.trials]
        # the last choice was a probe or an exploration, there to measure the draft: no prompt
        # lookup takes its place (not a field: no snapshot carries it)
        self.probing = False

    def snapshot(self) -> str:
        """The whole state as text: a seeded request continued by a retry
        (orchestrator/request_ids.py) goes on from it, and so chooses the γs an
        uninterrupted call would have, which its tokens depend on."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def restore(cls, text: str) -> SessionPolicy:
        return cls(**json.loads(text))

    def pooled_rates(self, costs: "CostModel") -> list[float]:
        """The session's rate c_i at each draft position 1..max_gamma: its kind's
        process-wide rates (`PositionRates`), which carry how the rule treats long drafts,
        scaled by how this session's own rounds compare with what those rates predict for
        them, shrunk towards 1 with `POOL_WEIGHT` draft tokens of weight. With rates equal
        at every position that is the session's α shrunk towards the kind's α, as before
        per-position rates. A deterministic (seeded) policy uses its own tokens only: one
        rate, its α."""
        pool = None if self.deterministic else costs.pool_rates(self.greedy, max(self.max_gamma, len(self.reached)))
        if pool is None:
            return [self.alpha] * self.max_gamma
        prior = POOL_WEIGHT * costs.pool_alpha(self.greedy)
        predicted = sum(mass * rate for mass, rate in zip(self.reached, pool))
        scale = (self.accepted + prior) / (predicted + prior) if predicted + prior > 0 else 1.0
        return [min(0.99, scale * rate) for rate in pool[: self.max_gamma]]

    @property
    def alpha(self) -> float:
        return min(0.99, self.accepted / self.trials)

    @property
    def guess_rate(self) -> float:
        return self.guessed / self.guesses

    def predraft_hit(self, gamma: int) -> float:
        """The chance that a pre-draft of the next round gets used: all γ accepted (the
        product of the rates up to γ) and the bonus token guessed right. Greedy guesses
        right about as often as it accepts (both are the two argmaxes agreeing). At
        temperature 1 the guess and the target's bonus are draws from q and p under the
        same noise (sampling.bonus_guess_rows), which agree 0.67 of the time on the bundled
        pair, against 0.20 for independent draws (Σ p·q); the rate still varies with the
        text, so it is learnt per session from the fully accepted rounds, not assumed. A
        function of the session's own tokens, so a seeded request stays reproducible."""
        return math.prod(self._rates(gamma)[:gamma]) * self.guess_rate

    def expected_tokens(self, gamma: int) -> float:
        """Tokens a round drafting γ yields at the last choice's rates (`expected_by_gamma`)."""
        return expected_by_gamma(self._rates(gamma)[:gamma])[-1]

    def _rates(self, gamma: int) -> list[float]:
        """The per-position rates of the last choice, or one α where it priced fewer positions."""
        return self.estimate if self.estimate is not None and len(self.estimate) >= gamma else [self.alpha] * gamma

    def branch_chances(self, gamma: int) -> list[float]:
        """For j = 0 .. γ − 1, the chance that a fork pre-drafted from the draft's runner-up at
        position j + 1 gets used: the round keeps exactly j tokens and the target corrects
        the next to that runner-up. A greedy session's own rates, so no load enters."""
        rates = self._rates(gamma)
        rate = self.runner_up_right / self.runner_up_tries
        return [math.prod(rates[:j]) * (1.0 - rates[j]) * rate for j in range(gamma)]

    def observe_runner_up(self, right: bool, decay: float = 0.95) -> None:
        """A forked round's correction was (not) the runner-up its fork was drafted from."""
        self.runner_up_right = decay * self.runner_up_right + float(right)
        self.runner_up_tries = decay * self.runner_up_tries + 1.0

    def observe_guess(self, right: bool, decay: float = 0.9) -> None:
        """A fully accepted round whose pre-draft's first token was (not) the bonus."""
        self.guessed = decay * self.guessed + float(right)
        self.guesses = decay * self.guesses + 1.0

    def observe(self, gamma: int, accepted: int, chances: Sequence[float] | None = None,
                decay: float = 0.9) -> None:
        """A round of γ draft tokens kept `accepted`; `chances` the target's keep chances
        (`keep_chances`): position i's chance is a success, and the chance of prefix i − 1
        its trial. With the kept length as 1s and 0s that is the count it always was:
        accepted tokens were successes, the first rejection (if any) one failure."""
        if gamma <= 0:
            return
        chances = keep_chances(gamma, accepted, chances)
        trials = reached_chances(chances)
        self.reached += [0.0] * (gamma - len(self.reached))
        self.reached = [decay * mass + (trials[i] if i < gamma else 0.0) for i, mass in enumerate(self.reached)]
        self.accepted = decay * self.accepted + sum(chances)
        self.trials = decay * self.trials + sum(trials)

    def choose(self, costs: CostModel) -> int:
        """This round's γ: of those whose expected tokens per ms of round (from the session's
        acceptance estimate and the measured costs) come near the best, the shortest
        (`shortest_near_best`; a seeded session the plain best, on the reference costs, so
        that it reproduces). Now and then a neighbour of the best (`_explore`), and while the
        best is γ = 0 a short draft, so that the costs and the acceptance stay measured."""
        if self.fixed is not None:
            return self.fixed
        rates = self.estimate = self.pooled_rates(costs)
        if self.deterministic:
            costs = REFERENCE
        table = costs.round_table(self.max_gamma)
        tokens = expected_by_gamma(rates)
        values = [tokens[g] / table[g] for g in range(self.max_gamma + 1)]
        # a seeded policy prices by the reference costs: its choice stays the plain best
        best = values.index(max(values)) if self.deterministic else shortest_near_best(values)
        self.rounds += 1
        self.probing = False
        if best > 0 and not self.deterministic and costs.alone and self.rounds % EXPLORE_EVERY == 0:
            self.probing = True
            return self._explore(best)
        if best == 0:
            if self.deterministic:  # a seeded session counts its own: its tokens must reproduce
                self.rounds_at_zero += 1
                due = self.rounds_at_zero % ZERO_PROBE_EVERY == 0
            else:
                due = costs.zero_probe(self.greedy)
            if due:
                self.probing = True
                return 2  # probe: keep α current so speculation can come back
        else:
            self.rounds_at_zero = 0
        return best

    def _explore(self, best: int) -> int:
        """The γ an exploring round tries, so that its cost gets measured: a neighbour of
        the best, above and below by turns, and every `PLAIN_EVERY`th time below, γ = 0. A
        session alone is never governed (orchestrator/governor.py), so only this measures
        what plain decoding costs it; unmeasured, the γ = 0 round is priced by the linear
        model scaled to the drafting rounds, which holds only while the target's forward
        grows with the tokens verified as the model's slope says. Where the target's
        multi-token forwards ran slow (t = 1, one stream, `make bench` 2026-12-06 09:28 UTC:
        a verification of 5 tokens 6.1 ms in the replica against 2.4 in one process),
        (e) speculated at mean γ 5.08 and made 328.6 tokens/s against 413.7 target-only."""
        turn = self.rounds // EXPLORE_EVERY
        if turn % 2:
            return min(self.max_gamma, best + 1)
        return 0 if turn % (2 * PLAIN_EVERY) == 0 else best - 1


def shortest_near_best(values: Sequence[float]) -> int:
    """The smallest γ whose value (expected tokens per ms) is within `NEAR_BEST` of the
    largest. Priced from the measured costs the curve is flat around its best (γ = 4 to 6
    within about 1 % at t = 1 here), while the stack's own speed by γ is not: the fixed-γ
    sweep of `make bench` (2026-12-06 17:49 UTC) made 660.9 tokens/s at γ = 4 against 607.4
    at 6 (t = 1) and 785.7 against 708.6 (greedy), a longer draft costing more than its
    calls' times show (the draft's and the orchestrator's CPU on cores the target shares, the
    target idling longer between its forwards). Taking the shortest of the near-best
    drafts, by turns against the plain best (`ab_probe`, 18:35-18:40 UTC): t = 1 one stream
    at mean γ 3.75-3.91 against 4.43-4.83, 1.04 and 1.05 × its tokens/s (paired medians,
    16 of 24 rounds faster), greedy 1.00-1.01, greedy at 4 streams 1.00."""
    top = max(values)
    return min(g for g, value in enumerate(values) if value >= (1 - NEAR_BEST) * top)


def _reference() -> CostModel:
    """A target step of 10 units, a draft step of 1 (c = 0.1) and half a unit per draft call,
    and 0.3 units (3 % of a step) per extra verified token: the bundled pair at batch 1,
    through the services. The forward alone costs more per token (`VERIFY_TOKEN_SLOPE`,
    15 %), but through the services each call's fixed cost flattens the curve, and the
    fixed-γ sweep of `make bench` at t = 1 put γ = 4 first (144.9 tokens/s against 137.8 at
    γ = 2). With these costs the choice is γ = 2, 3, 4, 5, 8 at α = 0.5, 0.6, 0.7, 0.8, 0.9."""
    ref = CostModel()
    ref.draft_call.update(0.5)
    ref.draft_step.update(1.0)
    ref.verify_base.update(10.0)
    ref.verify_token.update(0.3)
    ref.batch.update(1.0)
    return ref


REFERENCE = _reference()
