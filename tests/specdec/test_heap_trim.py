"""The replicas' heap trim: at most once an interval, and on glibc it gives freed memory back."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest

from specdec.heap_trim import HeapTrimmer

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


def _resident_mib() -> float:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@glibc
def test_trims_at_most_once_an_interval():
    now = [100.0]
    trimmer = HeapTrimmer(30.0, clock=lambda: now[0])
    assert trimmer.enabled
    assert not trimmer.maybe_trim()  # the interval counts from the start
    now[0] += 29.9
    assert not trimmer.maybe_trim()
    now[0] += 0.1
    assert trimmer.maybe_trim()
    assert not trimmer.maybe_trim()
    now[0] += 30.0
    assert trimmer.maybe_trim()
    assert trimmer.trims == 2 and trimmer.seconds > 0


def test_zero_turns_it_off():
    now = [0.0]
    trimmer = HeapTrimmer(0.0, clock=lambda: now[0])
    now[0] += 1e6
    assert not trimmer.enabled and not trimmer.maybe_trim() and trimmer.trims == 0


@glibc
def test_a_trim_gives_back_freed_memory_between_live_blocks():
    """Every other of 3,000 blocks of 64 KiB freed (below glibc's mmap threshold, so from its
    heap, where the live blocks above keep the freed ones from being trimmed at the top): about
    94 MiB freed that the allocator keeps, until the trim."""
    blocks = [bytearray(64 * 1024) for _ in range(3000)]  # zeroed: every page touched
    del blocks[::2]
    kept = _resident_mib()
    now = [0.0]
    trimmer = HeapTrimmer(1.0, clock=lambda: now[0])
    now[0] += 1.0
    assert trimmer.maybe_trim()
    assert kept - _resident_mib() > 40.0
    del blocks
