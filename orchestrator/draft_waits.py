"""How long the loop waits for a draft replica, and what it does about one that is late.

A draft call (a proposal, or a pre-draft the next round would use) not answered within
`wait` seconds is left to finish on its own and the round goes on target-only. A replica
that stalls without failing (a pause, a hang, a queue far too long) so costs its sessions
that wait once instead of the whole stall; the other sessions on it skip their drafts
while it owes a late call, rather than each wait for it in turn. Target-only rounds keep
the output law: a round's γ may be anything.
"""
from __future__ import annotations

import asyncio
import logging

from orchestrator.loop_state import Generation, Proposal
from specdec import metrics

log = logging.getLogger(__name__)


class DraftWaits:
    """The draft wait of one orchestrator, the replicas stalled now, and the calls and
    releases left running past the end of their generation."""

    def __init__(self, wait: float | None) -> None:
        self.wait = wait  # seconds a draft call is waited for (None: its whole timeout)
        self._stalled: dict[str, int] = {}  # draft replica → its calls late now
        self._background: set[asyncio.Future] = set()

    def wait_for(self, gen: Generation) -> float | None:
        """Seconds this session waits for a draft call (None: until it ends). A seeded
        sampled session waits its calls out: its tokens depend on where its rounds end,
        and it must reproduce (a replica that fails is replaced anyway)."""
        return None if gen.policy.deterministic else self.wait

    async def in_time(self, gen: Generation, task: asyncio.Future, calls: int = 1):
        """→ the draft call's result, or None where it has not come within the wait for
        each of its `calls`: the call is then left to finish on its own (`gen.late`) and
        the round goes on target-only."""
        if not task.done():
            wait = self.wait_for(gen)
            wait = None if wait is None else wait * calls
            try:
                await asyncio.wait((task,), timeout=wait)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if not task.done():
                gen.late = task
                self._note_stall(gen.handle.draft_replica, task)
                metrics.DRAFT_LATE.inc()
                log.info("draft replica %s has not answered session %s within %.0f ms; going on target-only "
                         "until it does", gen.handle.draft_replica, gen.handle.session_id, wait * 1000)
                return None
        return task.result()

    def stalled(self, address: str) -> bool:
        """Whether the replica owes some session a late call now."""
        return address in self._stalled

    def _note_stall(self, address: str, task: asyncio.Future) -> None:
        """A replica owes a late call until that call ends."""
        self._stalled[address] = self._stalled.get(address, 0) + 1

        def ended(_: asyncio.Future) -> None:
            left = self._stalled.pop(address, 1) - 1
            if left:
                self._stalled[address] = left

        task.add_done_callback(ended)

    def ready(self, gen: Generation) -> bool:
        """Whether the session may call its draft replica: not while a call it stopped
        waiting for is out, nor while that replica owes another session a late call
        (except a seeded sampled session, which waits its calls out)."""
        if gen.late is not None:
            if not gen.late.done():
                return False
            self._settle_late(gen)
        return not self.stalled(gen.handle.draft_replica) or gen.policy.deterministic

    def _settle_late(self, gen: Generation) -> None:
        """A late call has ended. A late proposal that did come fed the draft's cache the
        committed tokens it carried, which the next call need not feed again."""
        late, gen.late = gen.late, None
        if late.cancelled():
            return
        exc = late.exception()
        if exc is not None:  # its own failure handling has run (`Generator._propose`); nothing to add
            log.info("a late draft call of session %s failed: %s", gen.handle.session_id, exc)
            return
        got = late.result()
        if isinstance(got, Proposal):  # a pre-draft fed nothing the cursor counts
            cursor = gen.handle.cursor
            fed = got.ref.start + len(got.ref.tokens)
            cursor.draft_len = max(cursor.draft_len, min(fed, len(gen.handle.committed) - 1))

    def in_background(self, task: asyncio.Future) -> None:
        """Hold a task that outlives its generation until it ends, and take its outcome
        (its failure was handled where it arose)."""
        def ended(done: asyncio.Future) -> None:
            self._background.discard(done)
            if not done.cancelled():
                done.exception()

        self._background.add(task)
        task.add_done_callback(ended)
