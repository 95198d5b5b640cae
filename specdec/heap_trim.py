"""Giving the memory a replica has freed back to the system, now and then.

A replica's forwards allocate and free tensors of many sizes (prefill chunks of up to 256
positions, batches of 1 to 80 rows, their logits), and glibc's allocator keeps what is
freed in its arenas (the engine thread's and the event loop's) rather than handing it back.
Over a 30-minute soak the target replica's resident memory rose 2.19 MiB a minute while its
Python objects stayed flat; the engine alone swung 589-888 MiB over 40 rounds of sessions,
503-707 MiB with `malloc_trim(0)` after each round, which cost 2-7 ms a call
(benchmarks/HISTORY.md, "Resident memory over long soaks"). Side by side, two target
replicas with half of a 30-minute soak's load each rose +3.76 MiB a minute trimming
against +7.95 without, at the same engine time a batch. A pod's memory limit and the
autoscaler's memory signal read resident memory, so what the allocator keeps counts as used.

So a replica calls `malloc_trim(0)` at most every `--heap-trim-seconds`, from its heartbeat
and only while no batch runs (a call arriving meanwhile waits those few milliseconds, once
in that many seconds). Where the C library has no `malloc_trim` (musl, macOS) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """`maybe_trim` trims at most once every `every_s` seconds; 0 turns it off."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._trim = _malloc_trim() if every_s > 0 else None
        self._last = clock()
        self.trims = 0
        self.seconds = 0.0  # spent trimming

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed since the last one; → whether it trimmed."""
        now = self.clock()
        if self._trim is None or now - self._last < self.every_s:
            return False
        self._last = now
        t0 = time.perf_counter()
        released = self._trim(0)
        spent = time.perf_counter() - t0
        self.trims += 1
        self.seconds += spent
        log.debug("malloc_trim: %s in %.1f ms", "released memory" if released else "nothing to release",
                  spent * 1000)
        return True
