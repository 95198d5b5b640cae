"""Adaptive γ: the cost model recovers per-call and per-token costs from what the rounds
report, and the policy picks the γ that maximises expected tokens per millisecond."""
import itertools
import operator

import pytest

from orchestrator.gamma_policy import (EXPLORE_EVERY, FRESH_CALLS, NEAR_BEST, PLAIN_EVERY, MEASURED_AFTER, PREDRAFT_PROBE_EVERY,
                                       PREDRAFT_USE_AFTER, TABLE_REFRESH, CostModel, PositionRates,
                                       SessionPolicy, expected_by_gamma, keep_chances,
                                       shortest_near_best, verify_slope)


def _observe(costs: CostModel, gammas, net: float, draft_step: float, target_step: float, batch: int):
    for g in gammas:
        costs.observe_draft(g, net + g * draft_step, g * draft_step, batch)
        compute = target_step * (1 + verify_slope(batch) * g)
        costs.observe_verify(g, net + compute, batch, compute)


def expected_tokens(alpha: float, gamma: int) -> float:
    """The geometric model the policy reduces to with one rate at every position."""
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _policy(alpha: float) -> SessionPolicy:
    return SessionPolicy(accepted=alpha * 1000, trials=1000.0)


def test_costs_split_into_fixed_and_per_token_parts():
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    for g in range(9):
        truth = 10.0 * (1 + verify_slope(1) * g) + 2.0 + (g and 2.0 + g * 1.0)
        assert abs(costs.round_ms(g) - truth) < 1e-6 * truth


def test_choice_takes_the_shortest_draft_near_the_most_tokens_per_ms():
    costs = CostModel()
    _observe(costs, [3] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    for alpha in (0.5, 0.7, 0.8, 0.9):
        values = [expected_tokens(alpha, g) / costs.round_ms(g) for g in range(9)]
        chosen = _policy(alpha).choose(costs)
        assert values[chosen] >= (1 - NEAR_BEST) * max(values)
        assert all(values[g] < (1 - NEAR_BEST) * max(values) for g in range(chosen))
    assert _policy(0.9).choose(costs) > _policy(0.5).choose(costs) > 0


def test_shortest_near_best_prefers_a_shorter_draft_only_within_the_margin():
    assert shortest_near_best([1.0, 2.0, 2.95, 3.0, 2.99]) == 2  # 2.95 is within 3 % of 3.0
    assert shortest_near_best([1.0, 2.0, 2.9, 3.0, 2.99]) == 3  # 2.9 is not
    assert shortest_near_best([5.0, 1.0]) == 0


def test_gamma_shrinks_as_the_target_saturates_and_speculation_stops():
    idle, busy = CostModel(), CostModel()
    _observe(idle, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    _observe(busy, [4] * 50, net=2.0, draft_step=3.0, target_step=30.0, batch=32)
    assert _policy(0.6).choose(busy) < _policy(0.6).choose(idle)
    policy = _policy(0.15)
    picks = [policy.choose(busy) for _ in range(32)]
    assert picks.count(0) == 30 and picks.count(2) == 2  # off, with a short probe every 16 rounds


def test_speculation_comes_back_once_the_load_is_gone():
    """Times measured in loaded batches must not stay in the per-γ table (which speaks for
    sessions alone) and keep speculation off after the load has gone."""
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    _observe(costs, [4] * 50, net=2.0, draft_step=3.0, target_step=60.0, batch=16)
    assert not costs.alone and _policy(0.8).choose(costs) < 4
    for _ in range(40):  # the load has gone; sessions decode alone (γ = 0 while it was off)
        costs.observe_verify(0, 12.0, 1, 10.0)
    assert costs.alone
    assert _policy(0.8).choose(costs) >= 3


def test_choices_read_round_times_at_most_a_few_calls_old():
    """A choice reads a table of round times recomputed every TABLE_REFRESH observed calls
    (pricing every γ on every choice cost 100 µs a round), and at once when the load
    regime flips."""
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    first = list(costs.round_table(8))
    assert first == [costs.round_ms(g) for g in range(9)]
    costs.observe_verify(4, 40.0, 1, 30.0)  # a slow spell begins
    assert costs.round_table(8) == first and costs.round_ms(4) > first[4]
    for _ in range(TABLE_REFRESH - 1):
        costs.observe_verify(4, 40.0, 1, 30.0)
    assert costs.round_table(8)[4] == costs.round_ms(4) > first[4]
    while costs.alone:  # sessions start sharing batches: the next choice prices the load
        costs.observe_verify(4, 40.0, 16, 30.0, 80)
    assert costs.round_table(8) == [costs.round_ms(g) for g in range(9)]


def test_a_lookups_choice_reads_verify_times_kept_as_the_round_times_are():
    """Prompt lookup prices a round with no draft call (`verify_round_ms`) on every round of
    every session that may look up: its table is kept the same way, apart from round_table's."""
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    first = list(costs.verify_table(4))
    assert first == [costs.verify_round_ms(g) for g in range(len(first))] and len(first) > 4
    assert first != costs.round_table(4)[: len(first)], "the draft call is not in a lookup's price"
    costs.observe_verify(4, 40.0, 1, 30.0)
    assert costs.verify_table(4) == first and costs.verify_round_ms(4) > first[4]
    for _ in range(TABLE_REFRESH - 1):
        costs.observe_verify(4, 40.0, 1, 30.0)
    assert costs.verify_table(4)[4] == costs.verify_round_ms(4) > first[4]
    while costs.alone:
        costs.observe_verify(4, 40.0, 16, 30.0, 80)
    assert costs.verify_table(4) == [costs.verify_round_ms(g) for g in range(len(first))]


def test_a_rounds_own_overhead_is_priced_once_a_round_and_only_while_alone():
    """Time a round spends outside its calls is paid whatever γ is: counting it lifts every
    γ's round by the same amount, so a round of one token (γ = 0) loses the small margin
    that call times alone gave it."""
    costs = CostModel()
    _observe(costs, [2] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    alpha = 0.3  # speculation only just loses on call times alone
    tps = [expected_tokens(alpha, g) / costs.round_ms(g) for g in range(9)]
    assert tps.index(max(tps)) == 0 and max(tps[1:]) > 0.9 * tps[0]
    before = [costs.round_ms(g) for g in range(9)]
    for _ in range(50):
        costs.observe_round_overhead(6.0, 14.0)
    assert [costs.round_ms(g) - b for g, b in zip(range(9), before)] == pytest.approx([6.0] * 9)
    assert _policy(alpha).choose(costs) > 0
    costs.observe_round_overhead(900.0, 14.0)  # a stall (Redis restarting), not the loop's cost
    assert costs.round_ms(0) - before[0] == pytest.approx(6.0)
    busy = CostModel()
    _observe(busy, [4] * 50, net=2.0, draft_step=3.0, target_step=30.0, batch=16)
    loaded = busy.round_ms(4)
    busy.observe_round_overhead(6.0, 40.0)  # under load a session's own overhead overlaps the others' work
    assert busy.round_ms(4) == loaded


def test_measured_times_per_gamma_replace_the_linear_model():
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    modelled = costs.round_ms(6)
    for _ in range(MEASURED_AFTER):  # γ = 6 turns out much cheaper than the linear model says
        costs.observe_draft(6, 5.0, 4.0)
        costs.observe_verify(6, 12.0, 1, 11.0)
    assert costs.round_ms(6) == 5.0 + 12.0 < modelled


def test_the_choice_climbs_to_a_better_gamma_that_only_measuring_reveals():
    """Per-token costs look steep from γ = 2 alone; in truth they flatten out. Exploring
    the neighbours of the best γ measures them, and the choice moves up."""
    def true_round_ms(g: int) -> float:
        return 12.0 + (g and 3.0 + 0.3 * g)  # cheap extra tokens
    costs = CostModel()
    policy = _policy(0.85)
    for g in [2] * 50:  # what the linear model learns from γ = 2: 2 ms per extra token
        costs.observe_draft(g, 3.0 + 2.0 * g, 2.0 * g)
        costs.observe_verify(g, 12.0 + 0.3 * g, 1, 10.0 + 0.3 * g)
    first = policy.choose(costs)
    for _ in range(400):
        g = policy.choose(costs)
        if g:
            costs.observe_draft(g, 3.0 + 0.2 * g, 0.2 * g)
            costs.observe_verify(g, true_round_ms(g) - 3.0 - 0.2 * g, 1, 9.0)
    best = max(range(9), key=lambda g: expected_tokens(0.85, g) / true_round_ms(g))
    assert first < best
    assert policy.choose(costs) in (best - 1, best, best + 1)


def test_exploration_tries_both_neighbours_now_and_then_and_never_when_deterministic():
    costs = CostModel()
    _observe(costs, [3] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    policy = _policy(0.7)
    best = shortest_near_best([expected_tokens(0.7, g) / costs.round_ms(g) for g in range(9)])
    picks = [policy.choose(costs) for _ in range(2 * PLAIN_EVERY * EXPLORE_EVERY)]
    assert best > 1 and picks.count(best + 1) == PLAIN_EVERY and picks.count(best - 1) == PLAIN_EVERY - 1
    assert picks.count(0) == 1 and picks.count(best) == len(picks) - 2 * PLAIN_EVERY
    seeded = SessionPolicy(accepted=700.0, trials=1000.0, deterministic=True)
    assert len({seeded.choose(costs) for _ in range(8 * EXPLORE_EVERY)}) == 1


def test_under_load_the_model_decides_and_nobody_explores():
    """In shared batches a session's own wall time hides what its tokens cost the others."""
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=30.0, batch=16)
    modelled = costs.round_ms(6)
    for _ in range(2 * MEASURED_AFTER):
        costs.observe_draft(6, 5.0, 4.0)
        costs.observe_verify(6, 12.0, 16, 11.0)
    assert not costs.alone and abs(costs.round_ms(6) - modelled) / modelled < 0.5
    policy = _policy(0.7)
    assert len({policy.choose(costs) for _ in range(4 * EXPLORE_EVERY)}) == 1


def test_unmeasured_gammas_take_the_model_scaled_to_the_measurements():
    costs = CostModel()
    for ema, value in ((costs.draft_call, 2.0), (costs.draft_step, 1.0), (costs.verify_base, 10.0),
                       (costs.verify_token, 1.0), (costs.batch, 1.0)):
        ema.update(value)
    model_3 = costs.round_ms(3)  # 2 + 3 + 10 + 3 = 18
    # γ = 4 measured 20 % dearer than the model's 6 + 14 ms
    for _ in range(MEASURED_AFTER):
        costs.draft_by_gamma.update(4, 1.2 * 6.0)
        costs.verify_by_gamma.update(4, 1.2 * 14.0)
    assert model_3 == 18.0
    assert abs(costs.round_ms(3) - 1.2 * 18.0) < 1e-9
    assert abs(costs.round_ms(0) - 1.2 * 10.0) < 1e-9  # the verify-only round, scaled alike
    costs.batch.value = 16.0  # under load: the plain model again
    assert costs.round_ms(3) == 18.0


def test_stale_measurements_give_way_to_the_model_scaled_to_fresh_ones():
    """A γ measured in an earlier spell (cheaper greedy calls, say) must not stand beside
    one measured just now: after FRESH_CALLS calls without it, it is modelled from the
    fresh entries, and when it runs again it starts over."""
    costs = CostModel()
    _observe(costs, [3] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)  # the cheap spell
    assert costs.draft_by_gamma.measured(3) == 5.0
    _observe(costs, [4] * (FRESH_CALLS + 1), net=4.0, draft_step=1.5, target_step=12.0, batch=1)  # dearer now
    assert costs.draft_by_gamma.measured(3) is None and costs.verify_by_gamma.measured(3) is None
    fresh_4 = costs.round_ms(4)
    assert fresh_4 - 4 < costs.round_ms(3) < fresh_4  # scaled to γ = 4, not the old 5 + 17 ms
    costs.observe_draft(3, 8.5, 4.5)
    assert costs.draft_by_gamma.entries[3].count == 1  # restarted, not blended with the old spell
    assert costs.draft_by_gamma.measured(3) is None  # until measured MEASURED_AFTER times again


def test_deterministic_policy_choices_are_the_documented_ones():
    """The seeded policy's γ for a given α is fixed by the reference costs (its docstring
    lists them); a change to those costs changes what seeded requests produce."""
    chosen = [SessionPolicy(accepted=100.0 * a, trials=100.0, deterministic=True).choose(CostModel())
              for a in (0.5, 0.6, 0.7, 0.8, 0.9)]
    assert chosen == [2, 3, 4, 5, 8]


def test_a_session_leans_on_the_process_wide_alpha_of_its_kind():
    """Three unlucky rounds must not switch a session off where its kind accepts well;
    a seeded (deterministic) session uses its own tokens only."""
    costs = CostModel()
    _observe(costs, [3] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    for _ in range(100):  # other sampled sessions: each position kept at a rate of 0.75
        costs.observe_acceptance(False, 4, 3, [0.75 ** i for i in range(1, 5)])
        costs.observe_acceptance(True, 4, 0)  # greedy sessions do badly: a separate pool
    assert abs(costs.pool_alpha(False) - 0.75) < 1e-9 and costs.pool_alpha(True) == 0.0
    unlucky = SessionPolicy(accepted=0.0, trials=3.0)
    alone = max(range(9), key=lambda g: expected_tokens(unlucky.alpha, g) / costs.round_ms(g))
    assert alone == 0 and unlucky.choose(costs) >= 2
    assert unlucky.estimate == pytest.approx([8.0 * 0.75 / (3.0 + 8.0)] * 8)
    seeded = SessionPolicy(accepted=0.0, trials=3.0, deterministic=True)
    assert seeded.choose(costs) == 0 and seeded.estimate == [0.0] * 8
    assert CostModel().pool_alpha(False) is None  # no rounds yet: the session's own estimate


def test_kept_lengths_count_as_before_and_chances_refine_them():
    """With no chances (greedy) a round counts as it always did: accepted tokens are
    successes and the first rejection one failure; the chances of a sampled round give the
    same sums in expectation, position by position."""
    counted, legacy = SessionPolicy(), [3.0, 4.0]
    for gamma, accepted in [(4, 2), (4, 4), (2, 0), (6, 5)]:
        counted.observe(gamma, accepted)
        legacy = [0.9 * legacy[0] + accepted, 0.9 * legacy[1] + min(accepted + 1, gamma)]
    assert counted.accepted == pytest.approx(legacy[0]) and counted.trials == pytest.approx(legacy[1])
    assert sum(counted.reached) == pytest.approx(counted.trials)
    assert keep_chances(3, 1, None) == [1.0, 0.0, 0.0] and keep_chances(2, 0, [0.5, 0.25]) == [0.5, 0.25]
    assert expected_by_gamma([0.7] * 5) == pytest.approx([expected_tokens(0.7, g) for g in range(6)])


def test_position_rates_follow_each_position_and_carry_the_last_one_on():
    rates = PositionRates()
    for _ in range(30):  # a block-rule shape: later positions kept more often once reached
        rates.update([0.6, 0.6 * 0.7, 0.6 * 0.7 * 0.8])
    assert rates.rates(5) == pytest.approx([0.6, 0.7, 0.8, 0.8, 0.8])
    assert PositionRates().rates(2) == [0.75, 0.75]  # nothing yet: the sessions' prior


def test_a_long_draft_that_keeps_more_than_one_alpha_predicts_is_chosen():
    """Where later positions are kept more often (the block rule), the kind's per-position
    rates price long drafts by what they keep. One α fitted to a session's short rounds
    understates them and chooses shorter: the old policy, which this must beat. The choice
    is the argmax of the rates' expected tokens per millisecond."""
    shape = [0.62, 0.72, 0.8, 0.85, 0.88, 0.9, 0.9, 0.9]
    chances = list(itertools.accumulate(shape, operator.mul))
    shaped, single = SessionPolicy(), SessionPolicy()
    for _ in range(30):  # the session's own rounds drafted 3
        shaped.observe(3, 0, chances[:3])
        single.observe(3, 0, chances[:3])
    costs, flat = CostModel(), CostModel()
    for model, pool in ((costs, chances), (flat, [single.alpha ** i for i in range(1, 9)])):
        _observe(model, [4] * 50, net=3.0, draft_step=1.5, target_step=10.0, batch=1)
        for _ in range(60):  # the kind's rounds, longer drafts among them
            model.observe_acceptance(False, 8, 0, pool)
    g_shaped = shaped.choose(costs)
    tokens = expected_by_gamma(shaped.estimate)
    assert g_shaped == shortest_near_best([tokens[g] / costs.round_ms(g) for g in range(9)])
    assert shaped.estimate == pytest.approx(shape, rel=0.03)
    assert g_shaped > single.choose(flat) >= 1


def test_pre_drafting_stops_where_the_bonus_guess_is_seldom_right():
    """At temperature 1 the draft's guess and the target's bonus are independent draws:
    the session learns how often they agree instead of assuming α."""
    policy = SessionPolicy(accepted=80.0, trials=100.0)
    first = policy.predraft_hit(2)
    assert abs(first - 0.8 ** 2 * 2 / 3) < 1e-9 and first >= 0.25
    for _ in range(3):
        policy.observe_guess(False)
    assert policy.predraft_hit(2) < 0.25  # below the orchestrator's default threshold
    for _ in range(20):
        policy.observe_guess(True)
    assert policy.predraft_hit(2) > first



def test_branch_chances_are_the_kept_length_times_the_runner_up_rate():
    """A fork for kept length j is used when the round keeps exactly j tokens and the
    target corrects the next to the draft's runner-up; the runner-up rate is learnt."""
    policy = SessionPolicy(accepted=80.0, trials=100.0, greedy=True)
    chances = policy.branch_chances(3)
    assert chances == pytest.approx([0.2 / 3, 0.8 * 0.2 / 3, 0.64 * 0.2 / 3])
    # with the main pre-draft's all-kept case, the kept lengths cover everything
    assert sum(c * 3 for c in chances) + 0.8 ** 3 == pytest.approx(1.0)
    for _ in range(30):
        policy.observe_runner_up(True)
    assert policy.branch_chances(3)[0] > 0.15
    for _ in range(60):
        policy.observe_runner_up(False)
    assert policy.branch_chances(3)[0] < 0.02

def _loaded(forward_ms, batch: int, gammas=range(7), repeats: int = 10) -> CostModel:
    """A cost model that has seen loaded rounds of every γ in `gammas`, each verified in a
    batch of `batch` sessions feeding γ + 1 rows each, the forward costing forward_ms(rows)."""
    costs = CostModel()
    for _ in range(repeats):
        for g in gammas:
            costs.observe_draft(g, 1.0 + g, float(g), batch)
            rows = batch * (g + 1)
            costs.observe_verify(g, 1.0 + forward_ms(rows), batch, forward_ms(rows), rows)
    return costs


def test_under_load_gamma_follows_the_measured_forward_curve():
    """Where extra rows cost the forward little (a CPU's matrix kernels past their first
    extra row), γ stays long under load; where they cost much, it shrinks, and where the
    batch is large and rows dear, speculation stops. The fixed slope would price all alike."""
    cheap = _loaded(lambda rows: 10.0 + 0.05 * rows, batch=4)
    steep = _loaded(lambda rows: 10.0 + 1.5 * rows, batch=4)
    assert not cheap.alone and not steep.alone
    assert cheap.round_ms(4) == pytest.approx((1.0 + 4.0) + 1.0 + 10.0 + 0.05 * 20)
    assert _policy(0.7).choose(cheap) >= 3 > 2 >= _policy(0.7).choose(steep) > 0
    saturated = _loaded(lambda rows: 10.0 + 2.0 * rows, batch=16)
    assert _policy(0.5).choose(saturated) == 0


def test_after_target_only_rounds_speculation_still_starts_under_load():
    """Target-only rounds of two sessions measure the forward at 1-2 rows only, where a CPU's
    kernel jumps (the figures below: an orchestrator's /metrics after `stack_probe --configs
    greedy:2 --systems f`, 2026-12-02). Extrapolated at that slope, every draft looked dear
    and γ stayed 0 (CI of 2438010); above the measured rows the linear model caps the price,
    so speculation starts, and once its rows are measured the curve decides."""
    costs = CostModel()
    for _ in range(20):
        for rows, ms in ((1, 6.7), (2, 11.7)):
            costs.observe_verify(0, ms + 1.0, 2, ms, rows)
    assert not costs.alone and costs.forward.top()[0] == pytest.approx(2.0, abs=0.1)
    assert costs.round_ms(4) <= costs._model_draft(4) + costs._model_verify(4) + 1e-9
    assert costs.round_ms(4) >= costs.round_ms(0)  # never below the measured top
    assert _policy(0.75).choose(costs) >= 2
    for _ in range(10):  # drafts of four run, and their rows turn out dear: the curve decides
        costs.observe_verify(4, 41.0, 2, 40.0, 10)
    assert costs.forward.top()[0] == pytest.approx(10.0, abs=0.5)
    assert _policy(0.75).choose(costs) < 4


def test_without_rows_in_the_responses_the_linear_model_prices_gamma():
    """A target replica that reports no rows (older than the field) leaves the curve empty."""
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=30.0, batch=8)
    assert costs.forward.ms(40) is None
    assert costs.round_ms(3) == pytest.approx(costs._model_draft(3) + costs._model_verify(3))


def test_under_load_pre_drafts_stop_where_few_were_used_and_probe_now_and_then():
    """A wasted pre-draft under load costs the other sessions draft capacity: a sampling
    kind whose loaded pre-drafts were mostly wasted stops pre-drafting, but every
    PREDRAFT_PROBE_EVERY-th chance still tries, so the rate can recover. Alone, or with
    min_use 0, nothing stops."""
    costs = _loaded(lambda rows: 10.0 + 0.1 * rows, batch=4)
    assert all(costs.predraft_pays(False, 0.5) for _ in range(5))  # nothing measured yet
    for i in range(PREDRAFT_USE_AFTER + 20):
        costs.observe_predraft(False, i % 5 == 0)  # one in five used (t = 1 under load)
        costs.observe_predraft(True, i % 5 != 0)  # four in five (greedy)
    chances = [costs.predraft_pays(False, 0.5) for _ in range(4 * PREDRAFT_PROBE_EVERY)]
    assert chances.count(True) == 4  # the probes
    assert all(costs.predraft_pays(True, 0.5) for _ in range(20))  # greedy's are mostly used
    assert all(costs.predraft_pays(False, 0.0) for _ in range(20))  # the rule is off
    for _ in range(200):  # the load has gone: sessions alone, whatever the rate
        costs.observe_verify(0, 12.0, 1, 10.0, 1)
    assert costs.alone and costs.predraft_pays(False, 0.5)
    before = costs.predraft_use[False].count
    costs.observe_predraft(False, False)  # alone, a pre-draft's fate is not counted
    assert costs.predraft_use[False].count == before


def test_a_restored_snapshot_chooses_as_the_policy_it_was_taken_from():
    """A seeded request continued by a retry goes on from its committed policy state."""
    policy = SessionPolicy(deterministic=True)
    for gamma, kept in ((4, 4), (5, 2), (3, 0), (4, 3)):
        policy.observe(gamma, kept)
        policy.observe_guess(kept == gamma)
    copy = SessionPolicy.restore(policy.snapshot())
    assert copy == policy
    costs = CostModel()
    for kept in (2, 5, 1, 3):
        gamma = policy.choose(costs)
        assert copy.choose(costs) == gamma
        policy.observe(gamma, min(kept, gamma))
        copy.observe(gamma, min(kept, gamma))
    assert copy == policy


def test_a_probe_of_the_draft_says_so_so_that_no_lookup_takes_its_place():
    """When drafting is priced out, one choice in 16 is a probe (γ = 2) that keeps the draft's
    α and costs current; the policy marks it, and the orchestrator then lets the draft draft
    it rather than prompt lookup (orchestrator/generation.py)."""
    from orchestrator.gamma_policy import CostModel, SessionPolicy

    costs = CostModel()
    costs.draft_call.update(500.0)  # a draft far too slow to pay
    costs.draft_step.update(100.0)
    costs.verify_base.update(10.0)
    costs.verify_token.update(0.3)
    costs.batch.update(1.0)
    policy = SessionPolicy(greedy=True)
    picks = [(policy.choose(costs), policy.probing) for _ in range(32)]
    assert [p for p in picks if p[1]] == [(2, True), (2, True)]
    assert all(g == 0 for g, probing in picks if not probing)
    assert "probing" not in policy.snapshot()  # not state a retry restores


def test_short_sessions_priced_out_still_probe_one_choice_in_16_over_the_process():
    """Sessions of two rounds each never reach a 16th choice of their own: counted per
    session they never probed, and a kind once priced out stayed so. Over the process's
    sessions of a kind one zero choice in 16 probes; the other kind and a seeded session
    count their own."""
    from orchestrator.gamma_policy import ZERO_PROBE_EVERY

    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=3.0, target_step=30.0, batch=32)
    picks = [p for _ in range(48) for p in (lambda s: [s.choose(costs), s.choose(costs)])(_policy(0.15))]
    assert picks.count(2) == 96 // ZERO_PROBE_EVERY and picks.count(0) == 96 - 96 // ZERO_PROBE_EVERY
    assert picks[ZERO_PROBE_EVERY - 1] == 2  # the 16th choice, the first of the eighth session
    sampled = SessionPolicy(accepted=150.0, trials=1000.0, greedy=False)
    assert [sampled.choose(costs) for _ in range(ZERO_PROBE_EVERY - 1)] == [0] * (ZERO_PROBE_EVERY - 1)
    seeded = [SessionPolicy(accepted=0.0, trials=3.0, deterministic=True) for _ in range(2)]
    for policy in seeded:  # the reference costs price a session of α 0 out: probes at 16, 32
        assert [policy.choose(costs) for _ in range(32)].count(2) == 2


def test_a_session_alone_measures_plain_rounds_and_decodes_plainly_where_they_pay():
    """The linear model prices γ = 0 from the drafting rounds' forwards; where a forward of
    several tokens costs far more than its slope says (a kernel's jump past one row), it
    overprices the plain round and would keep a session alone speculating at a loss. Its
    explorations try γ = 0 now and then, and the measured time decides."""
    def truth(g: int) -> tuple[float, float]:  # (draft call ms, verify call ms)
        return (0.5 + 0.2 * g, 3.0 if g == 0 else 12.0 + 0.3 * g)
    costs, policy, picks = CostModel(), _policy(0.6), []
    for _ in range(600):
        g = policy.choose(costs)
        picks.append((g, policy.probing))
        draft, verify = truth(g)
        if g:
            costs.observe_draft(g, draft, draft - 0.3)
        costs.observe_verify(g, verify, 1, verify - 1.0)
    tokens = [expected_tokens(0.6, g) / (truth(g)[1] + (g and truth(g)[0])) for g in range(9)]
    assert max(range(9), key=tokens.__getitem__) == 0, "plain decoding is the better choice here"
    assert any(g > 1 for g, _ in picks[:20]), "the model's price of γ = 0 first says speculate"
    assert all(g == 0 for g, probing in picks[-100:] if not probing)
