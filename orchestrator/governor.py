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
smoothed over rounds and taken by powers of two (`load_bucket`) once per window, so that a
steady 16 streams, which read 15 and 16 by turns as requests end and start, is one load. The
measure is each mode's per-session token rate: tokens committed ÷ the wall time of the
rounds that committed them, which in a closed loop is throughput per session and in an
open one the inverse of time per output token, at the same load either way. Each mode's
rate is a decayed mean over its windows; the better one runs, and the other gets a window
now and then so its figure stays current (what speculation costs moves with the text, the
load and the machine): every `EXPLORE_EVERY`th window where the two are close, less often
the further apart they are, so that trying the loser costs about the same small share
(≈ GAP_UNIT ÷ EXPLORE_EVERY, 0.6 %) whatever the gap. With one window in 8 the governor
cost greedy 16 streams 2.5 % where speculating was 45 % faster (by turns against the policy
alone, 2026-12-03). Rounds in a window's first `SETTLE` are not counted:
they ran beside rounds chosen in the other mode.

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

WINDOW_S = 1.0  # seconds a mode holds before the next choice
SETTLE = 0.2  # share of a window whose rounds are not counted (they overlapped the other mode)
EXPLORE_EVERY = 8  # the losing mode runs one window in this many where the modes are close,
GAP_UNIT = 0.05  # and proportionally fewer per this much relative gap between their rates,
MAX_EXPLORE_EVERY = 64  # but at least one in this many
FIRST_WINDOWS = 2  # windows of each mode before the better one is preferred
MIN_ROUNDS = 8  # counted rounds a window needs before its rate counts
WEIGHT = 0.3  # of the newest window in a mode's decayed rate
LOAD_WEIGHT = 0.05  # of each round's count of generations in flight in the smoothed load


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
        self.rate = rate if self.rate is None else (1 - WEIGHT) * self.rate + WEIGHT * rate
        self.windows += 1


@dataclass
class _Key:
    """One sampling kind at one load: its two modes' rates and this window's tally."""
    on: ModeRate = field(default_factory=ModeRate)
    off: ModeRate = field(default_factory=ModeRate)
    speculating: bool = True  # the mode of the current window
    since_explore: int = 0  # windows since the losing mode last ran
    tokens: float = 0.0  # counted in the current window
    seconds: float = 0.0
    rounds: int = 0

    def close_window(self) -> None:
        """The window's rate joins its mode's; the next window's mode is chosen."""
        if self.rounds >= MIN_ROUNDS and self.seconds > 0:
            (self.on if self.speculating else self.off).update(self.tokens / self.seconds)
        self.tokens = self.seconds = 0.0
        self.rounds = 0
        self.speculating = self._next_mode()

    def _next_mode(self) -> bool:
        if self.on.windows < FIRST_WINDOWS:
            return True
        if self.off.windows < FIRST_WINDOWS:
            return False
        better = self.on.rate >= self.off.rate
        self.since_explore += 1
        if self.since_explore >= self.explore_every():
            self.since_explore = 0
            return not better
        return better

    def explore_every(self) -> int:
        """Windows between two of the losing mode's: `EXPLORE_EVERY` where the rates are
        close, more as their relative gap grows, at most `MAX_EXPLORE_EVERY`."""
        gap = abs(self.on.rate - self.off.rate) / max(self.on.rate, self.off.rate, 1e-9)
        return min(MAX_EXPLORE_EVERY, max(EXPLORE_EVERY, round(EXPLORE_EVERY * gap / GAP_UNIT)))


class LoadGovernor:
    """Per orchestrator process; the generation loop asks `speculating` before each round's
    choice and reports every governed round to `observe`."""

    def __init__(self, enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.clock = clock
        self.keys: dict[tuple[bool, int], _Key] = {}
        self.load = 1.0  # generations in flight, smoothed over rounds
        self.bucket = 0  # the load of the current window (load_bucket)
        self.window_start = clock()

    def _tick(self) -> float:
        """Seconds into the current window, closing the window that has ended."""
        now = self.clock()
        if now - self.window_start >= WINDOW_S:
            for (greedy, bucket), key in self.keys.items():
                was = key.speculating
                key.close_window()
                if key.speculating != was and key.on.rate is not None and key.off.rate is not None:
                    log.info("governor: %s sessions at load %d %s (tokens/s per session: on %.1f, off %.1f)",
                             "greedy" if greedy else "sampled", 2 ** bucket,
                             "speculate" if key.speculating else "decode target-only", key.on.rate, key.off.rate)
            self.window_start = now
            self.bucket = load_bucket(self.load)
        return now - self.window_start

    def speculating(self, greedy: bool, active: int) -> bool:
        """Whether a governed session of this kind, with `active` generations in flight,
        speculates in this round."""
        if not self.enabled or active < 2:
            return True
        self._tick()
        if self.bucket == 0:
            return True
        return self.keys.setdefault((greedy, self.bucket), _Key()).speculating

    def observe(self, greedy: bool, active: int, speculating: bool, tokens: int, seconds: float) -> None:
        """A governed round that ran in mode `speculating` committed `tokens` in `seconds`."""
        if not self.enabled:
            return
        self.load += LOAD_WEIGHT * (active - self.load)
        if active < 2:
            return
        into = self._tick()
        key = self.keys.get((greedy, self.bucket))
        if key is not None and key.speculating == speculating and into >= SETTLE * WINDOW_S:
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
