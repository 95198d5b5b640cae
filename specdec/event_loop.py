"""The servers' event loop: uvloop's where it is installed, asyncio's own otherwise.

Over the frame links (specdec/frames.py) every internal call is an asyncio socket write
and read in the orchestrator and in a replica, four hops a round, and at one stream those
hops are most of what a round spends beyond the two forwards. uvloop runs the loop and the
sockets' callbacks in C (libuv): a bare request and answer between two processes over
loopback, as the frame link frames them, took 80–95 µs against 118–131 µs with asyncio's
loop for 200 bytes, and 99 against 171–186 µs for 32 KB (a sampled proposal), medians of
2,800 (2026-12-05, ad hoc; benchmarks/HISTORY.md). gRPC's aio server and channels run on
either loop.
"""
from __future__ import annotations

import asyncio
import importlib.util
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


def resolve(choice: str) -> str:
    """`--event-loop` → the loop to run: auto is uvloop where it is installed, else asyncio;
    uvloop asked for where it is not installed is a configuration error (ValueError)."""
    if choice not in CHOICES:
        raise ValueError(f"the event loop must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    if importlib.util.find_spec("uvloop") is None:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop, but uvloop is not installed (pip install uvloop)")
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run `main` to completion on a new loop of the kind `resolve` chose → its result."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def running() -> str:
    """The running loop's kind, for the servers' start-up line: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
