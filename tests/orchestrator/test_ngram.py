"""orchestrator.ngram: prompt lookup proposes what followed the latest earlier occurrence of
the context's longest suffix (2..3 tokens), and its index, kept up to date round by round,
answers as a scan of the whole context would."""
import random

import pytest

from orchestrator.ngram import NgramIndex


def scan(tokens: list[int], k: int, max_n: int = 3, min_n: int = 2) -> list[int]:
    """The definition, by brute force: longest suffix first, its latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def test_the_latest_occurrence_of_the_longest_suffix_is_followed():
    index = NgramIndex()
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6, 7]
    # the suffix 5 6 7 occurs at 0 (→ 1 5 6 8); 5 6 occurs later at 4, but 3 tokens win
    assert index.propose(tokens, 4) == [1, 5, 6, 8]
    assert index.propose(tokens, 2) == [1, 5]
    assert index.propose(tokens + [3, 5, 6], 3) == [7, 3, 5]  # 5 6 latest at 9 (5 6 7 3 …)


def test_single_tokens_and_the_suffix_itself_are_not_matches():
    index = NgramIndex()
    assert index.propose([1, 2, 3, 4, 1], 4) == []  # only one token repeats
    assert index.propose([1, 2], 4) == []  # the suffix's own occurrence is not an earlier one
    assert index.propose([7, 7, 7], 4) == [7]  # 7 7 occurs at 0 (ends at 2): what follows it
    assert index.propose([1, 2, 1, 2], 0) == []


def test_the_running_index_answers_as_a_scan_of_the_context():
    rng = random.Random(3)
    for trial in range(60):
        vocab = rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        index = NgramIndex()
        for _ in range(40):  # rounds: each commits 1..5 tokens
            k = rng.randrange(1, 6)
            assert index.propose(tokens, k) == scan(tokens, k), (trial, tokens)
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]


def test_a_shorter_context_starts_the_index_again_and_bad_sizes_are_refused():
    index = NgramIndex()
    assert index.propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert index.propose([4, 5, 4], 2) == []  # not the context above: nothing of it is kept
    assert index.propose([4, 5, 6, 4, 5], 2) == [6, 4]
    with pytest.raises(ValueError):
        NgramIndex(max_n=2, min_n=3)


def loaded_costs(token_ms: float):
    """A cost model whose verification costs 10 ms plus token_ms per looked-up token."""
    from orchestrator.gamma_policy import CostModel

    costs = CostModel()
    costs.verify_base.update(10.0)
    costs.verify_token.update(token_ms)
    costs.batch.update(1.0)
    return costs


def test_lookups_are_as_long_as_their_kept_rate_pays_for_and_probe_when_priced_out():
    from orchestrator.ngram import LOOKUP_GAMMA, PROBE_EVERY, LookupPolicy

    cheap, dear = loaded_costs(0.3), loaded_costs(8.0)
    fresh = LookupPolicy()
    assert fresh.rate == pytest.approx(0.6)
    assert fresh.choose(cheap, LOOKUP_GAMMA) == LOOKUP_GAMMA  # 0.6 a token pays for 0.3 ms each
    assert fresh.choose(dear, LOOKUP_GAMMA) == 0  # not for 8 ms each (a loaded target)
    assert fresh.choose(cheap, 2) == 2  # never beyond the limit (the budget, the context)
    good, bad = LookupPolicy(), LookupPolicy()
    for _ in range(30):
        good.observe(4, 4)
        bad.observe(4, 0)
    assert good.rate > 0.95 and bad.rate < 0.05
    assert good.choose(dear, LOOKUP_GAMMA) == LOOKUP_GAMMA  # kept nearly always: pays even there
    choices = [bad.choose(cheap, LOOKUP_GAMMA) for _ in range(3 * PROBE_EVERY)]
    assert choices.count(1) == 3 and set(choices) == {0, 1}  # one probe every PROBE_EVERY rounds
    bad.observe(1, 1)
    assert bad.rate > 0.05  # what the probe kept counts


def test_a_sampled_lookup_learns_from_the_targets_keep_chances_as_greedy_from_its_kept_length():
    """Keep chances of 1s and 0s are a kept length: the same counts either way; fractional
    ones count what they say (their sum kept, the full draft's miss chance missed)."""
    from orchestrator.ngram import LookupPolicy

    by_length, by_chances = LookupPolicy(), LookupPolicy()
    for gamma, kept in ((4, 2), (3, 3), (2, 0), (4, 4)):
        by_length.observe(gamma, kept)
        by_chances.observe(gamma, kept, [1.0 if i < kept else 0.0 for i in range(gamma)])
        assert (by_chances.kept, by_chances.missed) == pytest.approx((by_length.kept, by_length.missed))
    sampled = LookupPolicy()
    sampled.observe(3, 0, [0.5, 0.25, 0.125])  # drawn nothing kept: the chances still count
    assert sampled.kept == pytest.approx(0.9 * 3.0 + 0.875)
    assert sampled.missed == pytest.approx(0.9 * 2.0 + 0.875)


def test_lookup_modes_and_the_flags_older_spelling():
    from orchestrator.ngram import MODES, lookup_mode

    assert [lookup_mode(m) for m in MODES] == list(MODES)
    assert lookup_mode("on") == "greedy"  # --prompt-lookup on, from before sampled lookups
    with pytest.raises(ValueError, match="greedy, all, off"):
        lookup_mode("sampled")


def test_a_new_sampled_session_starts_from_the_recent_sampled_lookups_greedy_from_the_fixed_prior():
    """Sampled lookups that are seldom kept leave the next sampled session priced out from
    its first round (it probes); ones that are kept make it eager; a session's prior weighs
    as the fixed one does, which greedy sessions keep."""
    from orchestrator.ngram import LOOKUP_GAMMA, PRIOR_KEPT, PRIOR_MISSED, LookupRates

    rates = LookupRates()
    first = rates.policy(False)
    assert first.rate == pytest.approx(0.6) and first.kept + first.missed == pytest.approx(PRIOR_KEPT + PRIOR_MISSED)
    for _ in range(300):
        rates.observe(3, 0, [0.05, 0.002, 0.0001])
    sampled = rates.policy(False)
    assert sampled.rate < 0.1 and sampled.kept + sampled.missed == pytest.approx(PRIOR_KEPT + PRIOR_MISSED)
    assert sampled.choose(loaded_costs(1.0), LOOKUP_GAMMA) == 0  # priced out from the start
    assert rates.policy(True).rate == pytest.approx(0.6)  # greedy: the fixed prior
    rates.observe(0, 0, None)  # nothing looked up: nothing learnt
    assert rates.policy(False).rate == pytest.approx(sampled.rate)
    for _ in range(300):
        rates.observe(4, 4, [0.99, 0.98, 0.97, 0.96])
    assert rates.policy(False).rate > 0.9
    assert rates.policy(False).choose(loaded_costs(8.0), LOOKUP_GAMMA) == LOOKUP_GAMMA
