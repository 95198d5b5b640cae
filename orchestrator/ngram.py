"""Prompt lookup: a draft without a draft model, for rounds no draft replica drafts.

The tokens that followed the latest earlier occurrence of the context's last n tokens
(n from MAX_NGRAM down to MIN_NGRAM) are proposed as the draft (Saxena's prompt lookup
decoding; vLLM's "ngram" speculator). Text repeats itself (code, quotes of the prompt,
lists), so such a guess is often right, and it costs no call and no draft compute: the
round is the target's verification alone. That is why it also serves where the load
governor has turned the draft off (the target saturated, the draft's work competing for
it): a lookup adds only verified rows, and `LookupPolicy` adds them only where the
session's lookups are kept often enough to pay for them at the current load.

Greedy sessions use it by default (`MODES`: greedy), where verification is a comparison
with the target's argmaxes and any proposal is lossless. Sampled sessions use it where
the orchestrator runs with `all`: the draft's law is then a point mass on each looked-up
token (specdec.encoding.point_masses), which the target verifies as exactly as any draft law
(x kept with chance p(x), a rejection drawn from p without x). It is not the default:
sampled text repeats less, and at t = 1 on the bundled pair a lookup was possible at 19 %
of positions and almost never kept (ad hoc, 2026-12-06), so its first rounds of a session
and its probes would cost verified rows for nothing. Seeded sampled sessions never look
up: their rounds must not depend on the load, and a lookup's price does. On the bundled
target's own greedy answers to the held-out prompts a lookup of up to 4 tokens was kept
83 % of the time, 2.21 tokens a round (ad hoc, 2026-12-06): these small models repeat
themselves more than large ones do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from orchestrator.gamma_policy import CostModel, expected_by_gamma, keep_chances

MODES = ("greedy", "all", "off")  # which sessions look up; "on", the flag's older spelling, is greedy
LOOKUP_GAMMA = 4  # tokens a lookup proposes at most, where the request fixes no γ
PRIOR_KEPT, PRIOR_MISSED = 3.0, 2.0  # a rate of 0.6, worth five tokens of evidence: before any lookup
POOL_DECAY = 0.99  # per sampled looked-up round: the process's rate follows its recent sessions
DECAY = 0.9  # per looked-up round: the text's repetitiveness changes as it goes
PROBE_EVERY = 8  # rounds a session that priced lookups out tries one token again
MAX_NGRAM = 3
MIN_NGRAM = 2  # one token matches too often by chance: a wrong guess costs a longer verification


class NgramIndex:
    """The n-grams of a session's committed tokens → where the latest earlier occurrence of
    each ends, kept up to date as tokens are committed, so that a lookup costs the new
    tokens rather than a scan of the whole context (the per-round hot path)."""

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 ≤ min_n ≤ max_n, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)
        self.ends: dict[tuple[int, ...], int] = {}  # an n-gram → the end of its latest indexed occurrence
        self.indexed = 0  # n-grams ending at positions ≤ this are in `ends`

    def _index(self, tokens: list[int], upto: int) -> None:
        if upto < self.indexed:  # another context: start again
            self.ends.clear()
            self.indexed = 0
        for end in range(self.indexed + 1, upto + 1):
            for n in self.sizes:
                if end >= n:
                    self.ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (MIN_NGRAM.. tokens) seen before, or [] where none was."""
        if k <= 0:
            return []
        # the suffix itself ends at len(tokens): index only occurrences that end before it
        self._index(tokens, len(tokens) - 1)
        for n in self.sizes:
            if len(tokens) > n:
                end = self.ends.get(tuple(tokens[-n:]))
                if end is not None:
                    return tokens[end:end + k]
        return []


@dataclass
class LookupPolicy:
    """One session's lookup length: the γ that maximises expected tokens per unit of the
    round's measured time (CostModel.verify_table: no draft call), under the rate at
    which this session's looked-up tokens were kept, each given the one before (a decayed
    count of kept tokens against rounds cut by a miss, from a prior worth five tokens: 0.6,
    or for a sampled session the rate of this process's recent sampled lookups,
    `LookupRates`)."""
    kept: float = PRIOR_KEPT
    missed: float = PRIOR_MISSED
    idle: int = 0  # rounds in a row priced at γ = 0
    decay: float = DECAY  # per observed round

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.missed)

    def tokens(self, gamma: int) -> float:
        """Expected tokens of a round that looks up γ: (1 − α^(γ+1)) / (1 − α) at its rate."""
        return expected_by_gamma([self.rate] * gamma)[-1]

    def observe(self, gamma: int, accepted: int, chances: Sequence[float] | None = None) -> None:
        """A looked-up round's outcome. Of a sampled one, `chances` (the target's chance per
        i = 1..γ that a prefix of i is kept; gamma_policy.keep_chances) count instead of the
        kept length: the same rate in expectation, with less noise."""
        chances = keep_chances(gamma, accepted, chances)
        self.kept = self.decay * self.kept + sum(chances)
        self.missed = self.decay * self.missed + (1.0 - chances[-1] if gamma else 0.0)

    def choose(self, costs: CostModel, limit: int) -> int:
        tokens = expected_by_gamma([self.rate] * limit)  # `tokens` of γ = 0 .. limit at once
        ms = costs.verify_table(limit)
        best = max(range(limit + 1), key=lambda g: tokens[g] / ms[g])
        self.idle = self.idle + 1 if best == 0 else 0
        if best == 0 and limit > 0 and self.idle % PROBE_EVERY == 0:
            return 1  # keep the rate current, or lookups could never come back
        return best


def lookup_mode(name: str) -> str:
    """A `--prompt-lookup` value → one of MODES; "on" (the flag before sampled lookups) is
    greedy, so configurations written for it keep their meaning."""
    mode = "greedy" if name == "on" else name
    if mode not in MODES:
        raise ValueError(f"prompt lookup must be one of {', '.join(MODES)} (or on), got {name!r}")
    return mode


class LookupRates:
    """The rate at which this process's recent sampled lookups were kept: a new sampled
    session's prior. A fixed prior cost each sampled session its first rounds: at t = 1 on
    the bundled pair lookups are seldom kept, and every session looked up 2-4 tokens a round
    until its own misses priced them out (`--prompt-lookup all` made 831.8 and 1,013.6
    tokens/s at 4 and 16 streams against 910.2 and 1,195.9 without it, by turns, 2026-12-06
    07:12 UTC). A sampled session starts where the ones before it ended instead: priced out
    where sampled text does not repeat (it probes), eager where it does. Greedy sessions keep
    the fixed prior: by turns against it, a pooled greedy prior looked up twice as often and
    read 0.97, 0.93 and 1.02 of its tokens/s at 1, 4 and 16 streams (07:19 UTC), no gain."""

    def __init__(self) -> None:
        self.pool = LookupPolicy(decay=POOL_DECAY)  # every sampled session's rounds, counted as one's

    @property
    def rate(self) -> float:
        return self.pool.rate

    def policy(self, greedy: bool) -> LookupPolicy:
        """A new session's policy: greedy, the fixed prior; sampled, the recent rate, worth
        the prior's five tokens."""
        if greedy:
            return LookupPolicy()
        weight = PRIOR_KEPT + PRIOR_MISSED
        return LookupPolicy(kept=weight * self.rate, missed=weight * (1.0 - self.rate))

    def observe(self, gamma: int, accepted: int, chances: Sequence[float] | None) -> None:
        """A sampled looked-up round's outcome."""
        if gamma > 0:
            self.pool.observe(gamma, accepted, chances)
