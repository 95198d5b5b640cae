"""Adaptive γ: the cost model recovers per-call and per-token costs from what the rounds
report, and the policy picks the γ that maximises expected tokens per millisecond."""
from orchestrator.gamma_policy import CostModel, SessionPolicy, expected_tokens, verify_slope


def _observe(costs: CostModel, gammas, net: float, draft_step: float, target_step: float, batch: int):
    for g in gammas:
        costs.observe_draft(g, net + g * draft_step, g * draft_step)
        compute = target_step * (1 + verify_slope(batch) * g)
        costs.observe_verify(g, net + compute, batch, compute)


def _policy(alpha: float) -> SessionPolicy:
    return SessionPolicy(accepted=alpha * 1000, trials=1000.0)


def test_costs_split_into_fixed_and_per_token_parts():
    costs = CostModel()
    _observe(costs, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    for g in range(9):
        truth = 10.0 * (1 + verify_slope(1) * g) + 2.0 + (g and 2.0 + g * 1.0)
        assert abs(costs.round_ms(g) - truth) < 1e-6 * truth


def test_choice_maximises_tokens_per_ms():
    costs = CostModel()
    _observe(costs, [3] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    for alpha in (0.5, 0.7, 0.8, 0.9):
        best = max(range(9), key=lambda g: expected_tokens(alpha, g) / costs.round_ms(g))
        assert _policy(alpha).choose(costs) == best
    assert _policy(0.9).choose(costs) > _policy(0.5).choose(costs) > 0


def test_gamma_shrinks_as_the_target_saturates_and_speculation_stops():
    idle, busy = CostModel(), CostModel()
    _observe(idle, [4] * 50, net=2.0, draft_step=1.0, target_step=10.0, batch=1)
    _observe(busy, [4] * 50, net=2.0, draft_step=3.0, target_step=30.0, batch=32)
    assert _policy(0.6).choose(busy) < _policy(0.6).choose(idle)
    policy = _policy(0.15)
    picks = [policy.choose(busy) for _ in range(32)]
    assert picks.count(0) == 30 and picks.count(2) == 2  # off, with a short probe every 16 rounds
