"""The servers a local stack starts end with the process that started them.

The stack starts each server in a session of its own (so that a Ctrl-C reaches the stack,
which stops them in order, and not every server at once). Without more, a parent killed
outright (SIGKILL, a closed terminal's SIGHUP, a crash before `LocalStack.stop`) left its
Redis, replicas and orchestrators serving on their ports, unseen, for as long as the
machine ran: five such stacks once sat beside a benchmark here. Linux can send a process a
signal when its parent dies (prctl PR_SET_PDEATHSIG), and the setting outlives exec; a
server leashed so gets SIGTERM and drains as it would under `LocalStack.stop`.

The tie is made by this file run as a trampoline (`leashed`), which sets it and execs the
server, not in a `preexec_fn`: that makes `subprocess` fork rather than vfork, and a fork
runs gRPC's fork handlers, which crashed the child (SIGSEGV) while other threads were in
gRPC calls (a soak restarting a server under load).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1


def leashed(args: list[str]) -> list[str]:
    """`args` (a command line) run so that the process ends when this one does, where such a
    tie holds: on Linux, started from the main thread (the kernel signals the child when the
    *thread* that forked it ends, and a pool's worker thread, such as an `asyncio.to_thread`'s,
    ends long before the process does: a soak starts its fresh servers on the loop's thread
    and waits for them on a worker). Elsewhere `args` unchanged. The process keeps the pid
    `Popen` gives: the trampoline execs the command in its place."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(args)
    return [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid()), *args]


def _tie_and_exec(parent: int, args: list[str]) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the tie was made
        sys.exit(1)
    os.execvp(args[0], args)


if __name__ == "__main__":
    _tie_and_exec(int(sys.argv[1]), sys.argv[2:])
