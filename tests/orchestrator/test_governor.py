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
                greedy: bool = False, active: int = 16, step: float = 0.01) -> list[bool]:
    """`windows` windows of settled rounds, one every `step` seconds, each mode committing
    `rate[mode]` tokens a second per session; the mode of each window, in order."""
    modes = []
    for _ in range(windows):
        modes.append(gov.speculating(greedy, active))
        key = gov.keys.get((greedy, load_bucket(active)))
        closed, start = (key.closed if key else 0), clock.now
        while True:
            clock.now += step
            mode = gov.speculating(greedy, active)
            if (key.closed > closed) if key else clock.now - start >= g.WINDOW_S:
                break
            gov.observe(greedy, active, mode, 1, 1.0 / rate[mode])
    return modes


def test_a_lone_generation_is_never_governed():
    gov, clock = loaded(1)
    modes = run_windows(gov, clock, 20, {True: 10.0, False: 100.0}, active=1)
    assert all(modes) and not gov.keys


def explorations(modes: list[bool], better: bool) -> list[int]:
    """The windows (after each mode's first two) that ran the losing mode."""
    return [i for i, mode in enumerate(modes[4:]) if mode != better]


def test_where_target_only_is_faster_it_runs_with_speculation_tried_now_and_then():
    gov, clock = loaded(16)
    modes = run_windows(gov, clock, 4 + 200, {True: 20.0, False: 25.0})
    assert modes[:4] == [True, True, False, False], "each mode is measured first"
    tried = explorations(modes, False)
    # a gap of 20 % is four GAP_UNITs: one window in 32; then, the loser confirmed, one in 64
    assert [b - a for a, b in zip(tried, tried[1:])] == [64, 64] and tried[0] == 31
    assert gov.keys[(False, 4)].explore_every() == g.MAX_EXPLORE_EVERY
    assert gov.table()["sampled,16,speculating"] in (0.0, 1.0)
    assert abs(gov.table()["sampled,16,off_tokens_per_s"] - 25.0) < 1e-6


def test_where_speculation_is_faster_it_stays_on():
    gov, clock = loaded(16)
    modes = run_windows(gov, clock, 4 + 120, {True: 26.5, False: 25.0}, greedy=True)
    tried = explorations(modes, True)
    # a gap of 6 %, just past the margin: one window in 9, then 18, 36 and 64 as the
    # loser stays the loser
    assert [b - a for a, b in zip(tried, tried[1:])] == [18, 36, 64][: len(tried) - 1] and tried[0] == 8
    assert gov.table()["greedy,16,on_tokens_per_s"] > gov.table()["greedy,16,off_tokens_per_s"]


def test_within_the_margin_target_only_runs_and_the_modes_do_not_trade_places():
    gov, clock = loaded(16)
    modes = run_windows(gov, clock, 4 + 60, {True: 25.0 * (1 + g.MARGIN * 0.8), False: 25.0})
    settled = modes[4:]
    assert explorations(modes, False) == [7, 23, 55], "speculation only in its exploring windows, ever rarer"
    switches = sum(a != b for a, b in zip(settled, settled[1:]))
    assert switches == 2 * 3  # into each exploring window and out of it
    with_no_margin, clock = loaded(16)
    with_no_margin.margin = 0.0
    with_no_margin.keys.clear()
    assert run_windows(with_no_margin, clock, 4 + 8, {True: 26.0, False: 25.0})[4:].count(True) >= 7


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
    gov.load, clock.now = 4.0, clock.now + g.WINDOW_S  # the load is read anew once a second
    assert not gov.speculating(False, 4), "another load starts from the choice made at the nearest"
    assert (False, 2) in gov.keys
    assert gov.keys[(False, 2)].on.windows == gov.keys[(False, 2)].off.windows == 0
    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 6, 11, 12, 16, 22)] == [0, 1, 2, 2, 2, 3, 3, 4, 4, 4]


def test_a_steady_load_that_reads_15_and_16_by_turns_is_one_load():
    clock = Clock()
    gov = LoadGovernor(clock=clock)
    for i in range(400):
        clock.now += 0.01
        active = 16 - i % 2
        gov.observe(False, active, gov.speculating(False, active), 1, 0.05)
    assert list(gov.keys) == [(False, 4)]


def test_rounds_of_the_other_mode_or_just_after_a_sessions_switch_are_not_counted():
    gov, clock = loaded(8)
    assert gov.speculating(False, 8)
    key = gov.keys[(False, 3)]
    gov.observe(False, 8, False, 5, 0.1)  # chosen in the other mode
    for n in range(1, g.SETTLE_ROUNDS + 1):  # the draft catching up after target-only rounds
        gov.observe(False, 8, True, 5, 0.4, rounds_in_mode=n)
    assert key.rounds == 0
    gov.observe(False, 8, True, 5, 0.1, rounds_in_mode=g.SETTLE_ROUNDS + 1)
    assert key.rounds == 1 and key.tokens == 5


def test_a_window_of_slow_rounds_lasts_until_it_has_counted_enough():
    gov, clock = loaded(16)
    gov.speculating(False, 16)
    key = gov.keys[(False, 4)]
    assert key.needs() == g.ROUNDS_PER_SESSION * 16
    for _ in range(key.needs() - 1):  # 3 s of rounds, one short of the window's need
        clock.now += 3 * g.WINDOW_S / key.needs()
        gov.observe(False, 16, True, 3, 0.3)
    assert gov.speculating(False, 16) and key.closed == 0, "still one round short"
    gov.observe(False, 16, True, 3, 0.3)
    gov.speculating(False, 16)
    assert key.closed == 1 and key.on.windows == 1 and abs(key.on.rate - 10.0) < 1e-9


def test_a_window_that_never_gathers_its_rounds_closes_and_teaches_nothing():
    gov, clock = loaded(8)
    gov.speculating(False, 8)
    key = gov.keys[(False, 3)]
    while clock.now < g.MAX_WINDOW_S:  # a round every half second: 16, not the 32 it needs
        clock.now += 0.5
        gov.observe(False, 8, True, 3, 0.05)
    gov.speculating(False, 8)
    assert key.closed == 1 and key.on.windows == 0


def test_off_means_the_policy_alone():
    gov, clock = loaded(16)
    gov.enabled = False
    assert all(run_windows(gov, clock, 20, {True: 10.0, False: 100.0}))


def test_a_burst_is_governed_as_its_load_from_its_first_round():
    clock = Clock()
    gov = LoadGovernor(clock=clock)
    for _ in range(200):  # a quiet spell: two generations
        clock.now += 0.01
        gov.observe(False, 2, gov.speculating(False, 2), 1, 0.05)
    clock.now += 0.3  # within a second of the last refresh, sixteen arrive
    gov.speculating(False, 16)
    gov.observe(False, 16, True, 1, 0.05)
    assert gov.speculating(False, 16) and gov.bucket == 4 and (False, 4) in gov.keys
    for i in range(50):  # and they leave: the load falls gradually, the bucket a second later
        clock.now += 0.01
        gov.observe(False, 1, gov.speculating(False, 1), 1, 0.05)
    assert gov.bucket == 4


def test_the_first_windows_weigh_alike():
    rate = g.ModeRate()
    for r in (70.0, 50.0):
        rate.update(r)
    assert rate.rate == 60.0, "a decayed mean would make it 64: the first window 70 % of it"
    for r in (50.0, 50.0, 50.0, 50.0, 50.0, 50.0):
        rate.update(r)
    assert 50.0 < rate.rate < 51.5, "then the newest weigh most"


def test_rounds_of_a_load_falling_away_are_not_counted():
    """As a burst's last generations finish, the load still reads the burst's for up to a
    second, but the few sessions left run far faster than that load's: their rounds would
    lift the mode they ran in."""
    gov, clock = loaded(16)
    gov.speculating(False, 16)
    key = gov.keys[(False, 4)]
    gov.observe(False, 16, True, 3, 0.05)
    assert key.rounds == 1
    for active in (10, 6, 3):
        clock.now += 0.01
        gov.observe(False, active, True, 3, 0.01)
    assert gov.bucket == 4 and key.rounds == 1 and key.tokens == 3


def test_a_window_left_open_while_the_load_went_away_starts_afresh():
    """Rounds counted just before an idle spell (the tail of a burst) and just after it (the
    next burst's first rounds) are no measure of a steady load: they are dropped."""
    gov, clock = loaded(16)
    gov.speculating(False, 16)
    key = gov.keys[(False, 4)]
    for _ in range(20):
        clock.now += 0.01
        gov.observe(False, 16, True, 5, 0.02)
    assert key.rounds == 20
    clock.now += 5.0  # the orchestrator serves other loads, or none
    gov.load = 16.0
    assert gov.speculating(False, 16)
    assert key.rounds == 0 and key.closed == 0 and key.start == clock.now


def test_a_new_load_is_measured_first_in_the_mode_chosen_at_the_nearest_load():
    gov, clock = loaded(16)
    modes = run_windows(gov, clock, 6, {True: 20.0, False: 25.0}, greedy=False)
    assert modes[:4] == [True, True, False, False] and not gov.keys[(False, 4)].preferred
    clock.now += g.WINDOW_S
    gov.load = 8.0
    modes = run_windows(gov, clock, 6, {True: 40.0, False: 45.0}, greedy=False, active=8)
    assert modes[:4] == [False, False, True, True], "target-only first, as at 16"
    assert not gov.keys[(False, 3)].preferred
    assert run_windows(gov, clock, 2, {True: 50.0, False: 45.0}, greedy=True, active=8) == [True, True], \
        "greedy, with no choice of its own yet, speculates first"


def test_a_load_passed_through_before_any_choice_takes_the_nearest_choice_when_it_returns():
    """A burst's wind-down makes a key for each load it passes, with the prior of that moment
    (none chosen yet: speculation); once the nearest load has chosen target-only, the
    passed-through load returns measuring target-only first, not its stale prior."""
    gov, clock = loaded(4)
    assert gov.speculating(False, 4), "nothing chosen anywhere yet: speculation first"
    passed = gov.keys[(False, 2)]
    clock.now += 0.3  # the wind-down goes on below this load
    gov.load, gov.bucket = 16.0, 4
    modes = run_windows(gov, clock, 6, {True: 20.0, False: 25.0})
    assert modes[:4] == [True, True, False, False] and gov.keys[(False, 4)].preferred is False
    clock.now += g.IDLE_S + 0.5
    gov.load, gov.bucket = 4.0, 2
    assert run_windows(gov, clock, 2, {True: 40.0, False: 45.0}, active=4) == [False, False]
    assert gov.keys[(False, 2)] is passed and passed.off.windows == 2


def test_a_measured_load_keeps_its_own_order_when_it_returns():
    gov, clock = loaded(4)
    assert run_windows(gov, clock, 1, {True: 40.0, False: 45.0}, active=4) == [True]
    gov.load, gov.bucket = 16.0, 4
    run_windows(gov, clock, 6, {True: 20.0, False: 25.0})
    clock.now += g.IDLE_S + 0.5
    gov.load, gov.bucket = 4.0, 2
    assert run_windows(gov, clock, 3, {True: 40.0, False: 45.0}, active=4) == [True, False, False], \
        "its first window measured speculation: its second follows, whatever 16 chose"
