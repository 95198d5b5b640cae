"""Speculation on or off under load, decided by what each did here just now.

The γ policy (orchestrator/gamma_policy.py) prices a round from measured costs, and its
price under load is a model: the target's forward by rows and the draft's time as if each
pool had hardware of its own. Where that model is wrong, speculation can lose to plain
decoding at high load, which the policy cannot see: on the 2-core AVX2 EPYC at t = 1 and
16 streams, adaptive γ made 335-338 tokens/s against 361 target-only, because the draft's
work shared the two cores with the target (benchmarks/HISTORY.md, 2026-12-02 19:53 run).
Greedy at the same load gained 7-13 % from speculating. Neither a cost model tuned to one
machine nor a switch fixed for one load can get both right everywhere.

So, while several sessions run at once, time is cut into windows, and in each window the
sessions of one sampling kind (greedy or sampled) at one load either speculate as the policy
says (ON) or decode target-only (OFF). The load is the number of generations in flight,
smoothed over rounds and taken by powers of two (`load_bucket`) once a second, so that a
steady 16 streams, which read 15 and 16 by turns as requests end and start, is one load; a
rising load is taken at once (at the start of a burst, a load still smoothed from the quiet
before it would run the burst's first second under a smaller load's choice). The
measure is each mode's per-session token rate: tokens committed ÷ the wall time of the
rounds that committed them, which in a closed loop is throughput per session and in an
open one the inverse of time per output token, at the same load either way. A session's
first `SETTLE_ROUNDS` rounds after its mode changed are not counted: after target-only
rounds the draft first catches up on every token they committed, and the next round still
runs beside the others' catch-ups, a cost of switching that the steady mode does not pay
(counting them, the target's own 12 layers as the draft at greedy 16 streams measured 13.7 tokens/s per session in
an ON window against 28–32 in the ON windows before, and the governor decoded target-only
at 429 tokens/s where speculating made 481, 2026-12-03). A window lasts at least
`WINDOW_S` and until it has counted `ROUNDS_PER_SESSION` rounds per generation of its load,
so that slow rounds (long drafts of a large draft model: 48 counted in a 1 s window at 16 streams)
are measured as well as fast ones. Each mode's rate is a decayed mean over its windows; the
better one runs (speculation only where it beats target-only by more than `MARGIN`: its
windows' rates leave out the rounds a switch costs, so two modes within the noise of each
other would otherwise trade places window after window and pay those rounds every time;
on the AVX-512 EPYC with the CPU kernels of 2026-12-03, t = 1 at 16 streams measured on 52.4
against off 52.2 tokens/s per session and flipped every window), and the other gets a window
now and then so its figure stays current (what
speculation costs moves with the text, the load and the machine): every `EXPLORE_EVERY`th
window where the two are close, less often the further apart they are, so that trying the
loser costs about the same small share whatever the gap, and half as often again after
each such window that left the choice as it was (each costs every session of its kind a
draft catch-up: at t = 1 and 16 streams, (e) at γ 0.26 made 786 against 855 tokens/s for
target-only by turns, 2026-12-03 22:35 UTC).

A window counts only what measures its load. A round whose own count of generations in
flight is of a smaller load is left out: as a burst's last generations finish, the load
falls over a second, and the few sessions left run far faster than the burst's. A window
left open while the load went elsewhere for over `IDLE_S` starts afresh when it returns,
rather than closing on the tail of one burst and the first rounds of the next. The first
windows of a mode weigh alike. A load measures first the mode chosen at the nearest load of
its kind that has chosen (speculation where none has): a load only passed through, as a
burst ramps up or winds down, may never get past its first windows. Before these, at t = 1
and 16 streams, a bench-like sequence (`make bench`'s 6 s of loaded warm-up, then (f), (d)
and (e) by turns, 2026-12-04) decided for speculation on two windows of 70.7 and 55.8
against 56.0 and 62.1 tokens/s per session, the first of them lifted by the burst's start,
and ran (e) at γ 0.67 and 0.25 (777.8 and 816.4 tokens/s against 865.1 and 905.5
target-only); after, at γ 0.04 (833.0 and 996.3 against 864.1 and 975.6).

Where it matters most is a draft too slow for its pool: with the target's own 12 layers in
bf16 as the draft (no bf16 kernels on this AVX2 CPU), the policy alone kept γ near 0 yet made
42 tokens/s at 16 streams against 310-431 target-only, its γ = 0 probes each catching the
slow draft up; governed, 317 greedy and 391 at t = 1 once both modes were measured
(benchmarks/HISTORY.md, "Load governor").

A lone session (one generation in flight) is never governed: the policy's measured times
speak for that case, and the bench's one-stream targets rest on them. Nor are fixed-γ or
seeded sampled requests (their γ is the request's, or deterministic). The output law is
the target's in either mode; only the speed changes.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

WINDOW_S = 1.0  # seconds a mode holds at least before the next choice
MAX_WINDOW_S = 8.0  # a window still short of its rounds then closes without a rate
IDLE_S = 1.0  # a load without governed rounds this long starts its window afresh
SETTLE_ROUNDS = 2  # a session's rounds after its mode changed that are not counted
ROUNDS_PER_SESSION = 4  # counted rounds a window needs, per generation of its load
EXPLORE_EVERY = 8  # the losing mode runs one window in this many where the modes are close,
GAP_UNIT = 0.05  # and proportionally fewer per this much relative gap between their rates,
MAX_EXPLORE_EVERY = 64  # but at least one in this many
FIRST_WINDOWS = 2  # windows of each mode before the better one is preferred
MARGIN = 0.05  # speculation runs only where its rate beats target-only's by more than this share
WEIGHT = 0.3  # of the newest window in a mode's decayed rate
LOAD_WEIGHT = 0.05  # of each round's count of generations in flight in the smoothed load (a
# count above it is taken whole: a load arrives at once and leaves gradually)


def load_bucket(load: float) -> int:
    """Generations in flight by the nearest power of two, 2^k for k ≥ 1 (0: alone): the
    bounds fall between powers (2.8, 5.7, 11.3, 22.6, ...), away from the loads of 2, 4, 8, 16
    streams that a steady load reads."""
    return max(0, round(math.log2(max(1.0, load))))


@dataclass
class ModeRate:
    """A mode's decayed per-session token rate over its windows."""
    rate: float | None = None
    windows: int = 0

    def update(self, rate: float) -> None:
        """The first windows weigh alike (a plain mean), later ones decay by `WEIGHT`: a
        decayed mean from the first window on would let that one window, which a single
        slow or fast spell can skew, make 70 % of the figure after two."""
        self.windows += 1
        weight = max(WEIGHT, 1.0 / self.windows)
        self.rate = rate if self.rate is None else (1 - weight) * self.rate + weight * rate


@dataclass
class _Key:
    """One sampling kind at one load: its two modes' rates and this window's tally."""
    bucket: int
    start: float  # when the current window began
    margin: float = MARGIN
    on: ModeRate = field(default_factory=ModeRate)
    off: ModeRate = field(default_factory=ModeRate)
    speculating: bool = True  # the mode of the current window
    first: bool = True  # the mode measured first (LoadGovernor._prior)
    seen: float = 0.0  # when a governed round last ran at this load
    since_explore: int = 0  # windows since the losing mode last ran
    preferred: bool | None = None  # the better mode at the last choice
    confirmed: int = 0  # runs of the losing mode in a row after which the better one stayed so
    exploring: bool = False  # the current window runs the losing mode
    closed: int = 0  # windows closed, with a rate or without
    tokens: float = 0.0  # counted in the current window
    seconds: float = 0.0
    rounds: int = 0

    def needs(self) -> int:
        """Counted rounds the window needs before it can close with a rate."""
        return ROUNDS_PER_SESSION * 2 ** self.bucket

    def due(self, now: float) -> bool:
        elapsed = now - self.start
        return elapsed >= WINDOW_S and (self.rounds >= self.needs() or elapsed >= MAX_WINDOW_S)

    def restart(self, now: float) -> None:
        """A new window in the same mode, what the open one counted dropped."""
        self.tokens = self.seconds = 0.0
        self.rounds = 0
        self.start = now

    def close_window(self, now: float) -> None:
        """The window's rate joins its mode's (if it counted its rounds); the next window's
        mode is chosen."""
        if self.rounds >= self.needs() and self.seconds > 0:
            (self.on if self.speculating else self.off).update(self.tokens / self.seconds)
        self.restart(now)
        self.closed += 1
        self.speculating = self._next_mode()

    def _next_mode(self) -> bool:
        first, then = (self.on, self.off) if self.first else (self.off, self.on)
        if first.windows < FIRST_WINDOWS:
            return self.first
        if then.windows < FIRST_WINDOWS:
            return not self.first
        better = self.on.rate > (1 + self.margin) * self.off.rate
        if better != self.preferred:
            self.confirmed = 0
        elif self.exploring:
            self.confirmed += 1
        self.preferred, self.exploring = better, False
        self.since_explore += 1
        if self.since_explore >= self.explore_every():
            self.since_explore = 0
            self.exploring = True
            return not better
        return better

    def explore_every(self) -> int:
        """Windows between two of the losing mode's: `EXPLORE_EVERY` where the rates are
        close, more as their relative gap grows, and twice as many after each run of the
        loser that left it the loser, at most `MAX_EXPLORE_EVERY`."""
        gap = abs(self.on.rate - self.off.rate) / max(self.on.rate, self.off.rate, 1e-9)
        base = max(EXPLORE_EVERY, round(EXPLORE_EVERY * gap / GAP_UNIT))
        return min(MAX_EXPLORE_EVERY, base * 2 ** min(self.confirmed, 6))


class LoadGovernor:
    """Per orchestrator process; the generation loop asks `speculating` before each round's
    choice and reports every governed round to `observe`."""

    def __init__(self, enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 margin: float = MARGIN) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"the governor's margin must be in [0, 1), not {margin}")
        self.enabled = enabled
        self.margin = margin
        self.clock = clock
        self.keys: dict[tuple[bool, int], _Key] = {}
        self.load = 1.0  # generations in flight, smoothed over rounds
        self.bucket = 0  # load_bucket(load), refreshed once every WINDOW_S, or at once when it rises
        self.bucket_at = clock()

    def _key(self, greedy: bool) -> _Key | None:
        """The current load's key for this kind, its window closed if it is due."""
        now = self.clock()
        bucket = load_bucket(self.load)
        if bucket > self.bucket or now - self.bucket_at >= WINDOW_S:
            self.bucket, self.bucket_at = bucket, now
        if self.bucket == 0:
            return None
        key = self.keys.get((greedy, self.bucket))
        if key is None:
            prior = self._prior(greedy, self.bucket)
            key = self.keys[(greedy, self.bucket)] = _Key(self.bucket, now, self.margin, speculating=prior,
                                                          first=prior)
        elif now - key.seen > IDLE_S:
            if not key.on.windows and not key.off.windows:  # met before, never measured:
                key.first = key.speculating = self._prior(greedy, self.bucket)  # the prior as of now
            key.restart(now)
        elif key.due(now):
            self._close(greedy, key, now)
        key.seen = now
        return key

    def _prior(self, greedy: bool, bucket: int) -> bool:
        """The mode a load measures first: the choice made at the nearest load of the same
        kind that has made one (the higher of two as near), else speculation. Speculation
        pays less as the load grows, so where it lost at 16 streams it likely loses at 8
        too; a load that is only passed through (the tail of a burst, as its last
        generations finish) may never get past its first windows, which should not be
        the loser's. A load met before but never measured (passed through as an earlier
        burst wound down, while the loads near it had not chosen yet) takes it afresh when
        it returns: at t = 1, 4 streams after 16, whose choice was target-only, a key made
        in the first 16-stream burst's wind-down ran its first windows speculating at 243-
        268 tokens/s per session against 349-353 target-only (benchmarks/HISTORY.md)."""
        known = [(abs(b - bucket), -b, key.preferred) for (kind, b), key in self.keys.items()
                 if kind == greedy and key.preferred is not None]
        return min(known)[2] if known else True

    @staticmethod
    def _close(greedy: bool, key: _Key, now: float) -> None:
        was, kind, load = key.speculating, "greedy" if greedy else "sampled", 2 ** key.bucket
        log.debug("governor window: %s load %d %s, %d rounds, %.1f tokens/s per session", kind, load,
                  "on" if was else "off", key.rounds, key.tokens / key.seconds if key.seconds else 0.0)
        key.close_window(now)
        if key.speculating != was and key.on.rate is not None and key.off.rate is not None:
            log.info("governor: %s sessions at load %d %s (tokens/s per session: on %.1f, off %.1f)", kind, load,
                     "speculate" if key.speculating else "decode target-only", key.on.rate, key.off.rate)

    def speculating(self, greedy: bool, active: int) -> bool:
        """Whether a governed session of this kind, with `active` generations in flight,
        speculates in this round."""
        if not self.enabled or active < 2:
            return True
        key = self._key(greedy)
        return True if key is None else key.speculating

    def observe(self, greedy: bool, active: int, speculating: bool, tokens: int, seconds: float,
                rounds_in_mode: int = SETTLE_ROUNDS + 1) -> None:
        """A governed round that ran in mode `speculating` committed `tokens` in `seconds`; it
        was its session's `rounds_in_mode`th round in a row in that mode (counted past
        `SETTLE_ROUNDS`)."""
        if not self.enabled:
            return
        self.load = float(active) if active > self.load else self.load + LOAD_WEIGHT * (active - self.load)
        if active < 2:
            return
        key = self._key(greedy)
        if (key is not None and key.speculating == speculating and rounds_in_mode > SETTLE_ROUNDS
                and load_bucket(active) == key.bucket):
            key.tokens += tokens
            key.seconds += seconds
            key.rounds += 1

    def table(self) -> dict[str, float]:
        """For the metrics: per kind and load, each mode's rate and whether it speculates."""
        out = {}
        for (greedy, bucket), key in sorted(self.keys.items()):
            name = f"{'greedy' if greedy else 'sampled'},{2 ** bucket}"
            out[f"{name},speculating"] = float(key.speculating)
            for mode, rate in (("on", key.on), ("off", key.off)):
                if rate.rate is not None:
                    out[f"{name},{mode}_tokens_per_s"] = rate.rate
        return out
