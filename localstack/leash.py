"""The servers a local stack starts end with the process that started them.

The stack starts each server in a session of its own (so that a Ctrl-C reaches the stack,
which stops them in order, and not every server at once). Without more, a parent killed
outright (SIGKILL, a closed terminal's SIGHUP, a crash before `LocalStack.stop`) left its
Redis, replicas and orchestrators serving on their ports, unseen, for as long as the
machine ran: five such stacks once sat beside a benchmark here. Linux can send a child a
signal when its parent dies (prctl PR_SET_PDEATHSIG); a child leashed so gets SIGTERM and
drains as it would under `LocalStack.stop`.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_SIGTERM = int(signal.SIGTERM)


def _find_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # looked up here: the forked child must not load or import anything


def leash() -> Callable[[], None] | None:
    """A `preexec_fn` that ties the child about to start to this process, or None where no
    tie would hold: off Linux, and in any thread but the main one (the kernel signals the
    child when the *thread* that forked it ends, and a pool's worker thread, such as a soak's
    `asyncio.to_thread`, ends long before the process does)."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def tie() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the tie
            os._exit(1)

    return tie
