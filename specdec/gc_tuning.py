"""The cyclic garbage collector, tuned for a long-running server.

Every process here imports torch, transformers and grpc (about 200,000 objects), and a
replica adds its model and tokenizer (about 380,000 in all): a full (generation-2)
collection walks them all, and each full collection stalls every session the process
serves. Measured on this 2-core CPU (gc.callbacks in each process of a local stack,
2026-12-01): 130–320 ms per full collection in each of the orchestrator, the draft and
the target replica. What start-up loads (modules, the model, the tokenizer)
lives as long as the process, so once start-up is done it is moved to the permanent
generation (`gc.freeze`): later full collections walk only what serving allocated,
which reference counting frees anyway in the common case. The pauses that remain are
exported per generation, so that a latency tail can be matched against them.
"""
from __future__ import annotations

import gc
import time

from specdec import metrics

_started: list[float] = []


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        metrics.GC_PAUSE_SECONDS.labels(str(info["generation"])).observe(time.perf_counter() - _started.pop())


def freeze_startup_heap() -> int:
    """Collect once, then exempt everything alive from later collections; → the number of
    objects frozen. Call it when start-up is done, just before serving. Also starts
    exporting each collection's pause (once per process)."""
    gc.collect()
    gc.freeze()
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    frozen = gc.get_freeze_count()
    metrics.GC_FROZEN_OBJECTS.set(frozen)
    return frozen
