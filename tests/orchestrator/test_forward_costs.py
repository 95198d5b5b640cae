"""The target forward's cost curve by rows, as the orchestrator learns it from responses."""
import pytest

from orchestrator.forward_costs import BUCKETS, POINT_AFTER, ForwardCosts, bucket_of


def _measured(points: dict[int, float], times: int = POINT_AFTER) -> ForwardCosts:
    costs = ForwardCosts()
    for rows, ms in points.items():
        for _ in range(times):
            costs.observe(rows, ms)
    return costs


def test_rows_fall_into_the_largest_bucket_at_or_below_them():
    assert [bucket_of(r) for r in (1, 8, 9, 11, 33, 255, 256, 1000)] == [1, 8, 8, 10, 32, 224, 256, 256]
    assert bucket_of(0) == BUCKETS[0]


def test_no_curve_until_two_points_are_measured():
    costs = _measured({4: 10.0})
    assert costs.ms(4) is None  # one point says nothing about what more rows cost
    assert costs.table() == {4: 10.0}  # what /metrics shows: every bucket, measured enough or not
    costs.observe(20, 12.0)
    assert costs.ms(4) is None  # a bucket is a point only after POINT_AFTER observations
    for _ in range(POINT_AFTER - 1):
        costs.observe(20, 12.0)
    assert costs.ms(4) == 10.0


def test_between_points_the_curve_is_linear_and_below_the_first_it_is_flat():
    costs = _measured({4: 10.0, 20: 14.0, 48: 28.0})
    assert costs.ms(12) == pytest.approx(12.0)
    assert costs.ms(34) == pytest.approx(21.0)
    assert costs.ms(1) == costs.ms(4) == 10.0


def test_a_point_sits_at_the_mean_rows_of_its_bucket():
    costs = ForwardCosts()
    for rows in (16, 18) * 20:  # both in bucket 16
        costs.observe(rows, 20.0)
    costs.observe(4, 10.0)
    [(low, _), (high, _)] = [(p.rows, p.ms) for p in sorted(costs.points.values(), key=lambda p: p.rows)]
    assert low == 4 and 16 < high < 18


def test_noise_never_makes_more_rows_cheaper():
    costs = _measured({4: 10.0, 8: 9.0, 16: 15.0})
    assert costs.ms(8) == 10.0  # the running maximum, not the noisy dip
    assert costs.ms(6) == 10.0


def test_above_the_last_point_the_curve_rises_at_the_steeper_slope():
    flat_end = _measured({4: 10.0, 20: 26.0, 24: 26.4})  # last segment 0.1 ms/row, mean 0.82
    assert flat_end.ms(34) == pytest.approx(26.4 + 0.82 * 10)
    steep_end = _measured({4: 10.0, 20: 11.6, 24: 14.0})  # last 0.6, mean 0.2
    assert steep_end.ms(34) == pytest.approx(14.0 + 0.6 * 10)


def test_reports_without_rows_or_time_are_ignored():
    costs = ForwardCosts()
    costs.observe(0, 10.0)  # a replica too old to report its rows
    costs.observe(5, 0.0)
    costs.observe(5, float("nan"))
    assert costs.points == {}


def test_recent_batches_count_most():
    costs = _measured({4: 10.0, 20: 14.0}, times=5)
    for _ in range(60):  # the machine got slower
        costs.observe(4, 20.0)
    assert costs.ms(4) == pytest.approx(20.0, rel=0.01)


def test_top_is_the_last_measured_point():
    costs = ForwardCosts()
    assert costs.top() is None
    for _ in range(3):
        costs.observe(2, 8.0)
        costs.observe(12, 10.0)
    costs.observe(40, 30.0)  # one observation: not a point yet
    assert costs.top() == (pytest.approx(12.0), 10.0)
