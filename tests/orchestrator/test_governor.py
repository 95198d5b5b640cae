"""The load governor: per sampling kind and load, the faster of speculating and not."""
from __future__ import annotations

from orchestrator import governor as g
from orchestrator.governor import LoadGovernor, load_bucket


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def loaded(active: int) -> tuple[LoadGovernor, Clock]:
    """A governor whose smoothed load already reads `active` generations."""
    clock = Clock()
    gov = LoadGovernor(clock=clock)
    gov.load, gov.bucket = float(active), load_bucket(active)
    return gov, clock


def run_windows(gov: LoadGovernor, clock: Clock, windows: int, rate: dict[bool, float],
                greedy: bool = False, active: int = 16) -> list[bool]:
    """`windows` windows of rounds, each mode committing `rate[mode]` tokens a second per
    session; the mode of each window, in order."""
    modes = []
    for _ in range(windows):
        mode = gov.speculating(greedy, active)
        modes.append(mode)
        start = clock.now
        while clock.now - start < g.WINDOW_S - 0.011:
            clock.now += 0.01
            gov.observe(greedy, active, gov.speculating(greedy, active), 1, 1.0 / rate[mode])
        clock.now = start + g.WINDOW_S
    return modes


def test_a_lone_generation_is_never_governed():
    gov, clock = loaded(1)
    modes = run_windows(gov, clock, 20, {True: 10.0, False: 100.0}, active=1)
    assert all(modes) and not gov.keys


def test_where_target_only_is_faster_it_runs_with_speculation_tried_now_and_then():
    gov, clock = loaded(16)
    modes = run_windows(gov, clock, 4 + 6 * 32, {True: 20.0, False: 25.0})
    assert modes[:4] == [True, True, False, False], "each mode is measured first"
    settled = modes[4:]
    assert gov.keys[(False, 4)].explore_every() == 32, "a gap of 20 % is four GAP_UNITs: one window in 32"
    assert settled.count(True) == 6
    assert gov.table()["sampled,16,speculating"] in (0.0, 1.0)
    assert abs(gov.table()["sampled,16,off_tokens_per_s"] - 25.0) < 1e-6


def test_where_speculation_is_faster_it_stays_on():
    gov, clock = loaded(16)
    modes = run_windows(gov, clock, 4 + 6 * g.EXPLORE_EVERY, {True: 25.5, False: 25.0}, greedy=True)
    assert gov.keys[(True, 4)].explore_every() == g.EXPLORE_EVERY, "close rates: the loser runs most often"
    assert modes[4:].count(False) == 6
    assert gov.table()["greedy,16,on_tokens_per_s"] > gov.table()["greedy,16,off_tokens_per_s"]


def test_the_choice_follows_a_change_in_which_mode_is_faster():
    gov, clock = loaded(16)
    run_windows(gov, clock, 30, {True: 30.0, False: 25.0})
    later = run_windows(gov, clock, 120, {True: 20.0, False: 25.0})
    assert later[-30:].count(False) >= 28


def test_trying_the_losing_mode_gets_rarer_as_it_falls_behind():
    gov, clock = loaded(16)
    modes = run_windows(gov, clock, 4 + 3 * g.MAX_EXPLORE_EVERY, {True: 50.0, False: 25.0}, greedy=True)
    assert gov.keys[(True, 4)].explore_every() == g.MAX_EXPLORE_EVERY
    assert modes[4:].count(False) == 3


def test_kinds_and_loads_are_governed_apart():
    gov, clock = loaded(16)
    run_windows(gov, clock, 42, {True: 20.0, False: 25.0}, greedy=False, active=16)
    assert not gov.speculating(False, 16)
    assert gov.speculating(True, 16), "greedy has measured nothing yet: it speculates"
    gov.bucket = load_bucket(4)
    assert gov.speculating(False, 4), "another load has measured nothing yet"
    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 6, 11, 12, 16, 22)] == [0, 1, 2, 2, 2, 3, 3, 4, 4, 4]


def test_a_steady_load_that_reads_15_and_16_by_turns_is_one_load():
    clock = Clock()
    gov = LoadGovernor(clock=clock)
    for i in range(400):
        clock.now += 0.01
        active = 16 - i % 2
        gov.observe(False, active, gov.speculating(False, active), 1, 0.05)
    assert list(gov.keys) == [(False, 4)]


def test_rounds_of_the_other_mode_or_in_a_windows_first_part_are_not_counted():
    gov, clock = loaded(8)
    assert gov.speculating(False, 8)
    key = gov.keys[(False, 3)]
    clock.now = 0.5 * g.SETTLE * g.WINDOW_S
    gov.observe(False, 8, True, 5, 0.1)  # in the settling part
    clock.now = 0.5
    gov.observe(False, 8, False, 5, 0.1)  # chosen in the other mode
    assert key.rounds == 0
    gov.observe(False, 8, True, 5, 0.1)
    assert key.rounds == 1 and key.tokens == 5


def test_a_window_with_too_few_rounds_teaches_nothing():
    gov, clock = loaded(8)
    gov.speculating(False, 8)
    for _ in range(g.MIN_ROUNDS - 1):
        clock.now += 0.1
        gov.observe(False, 8, True, 3, 0.05)
    clock.now = g.WINDOW_S + 0.01
    gov.speculating(False, 8)
    assert gov.keys[(False, 3)].on.windows == 0


def test_off_means_the_policy_alone():
    gov, clock = loaded(16)
    gov.enabled = False
    assert all(run_windows(gov, clock, 20, {True: 10.0, False: 100.0}))
