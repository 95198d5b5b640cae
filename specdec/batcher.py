"""Continuous micro-batching for a model engine.

Calls from many sessions queue up; one worker takes *everything queued* and runs it as
one batch in a single engine thread. A lone call runs at once (nobody waits for company);
calls that arrive while a batch runs form the next batch. The model runs off the event
loop, so the gRPC server keeps answering health checks and new calls meanwhile.

Under load, sessions drift apart: each batch holds whoever happened to be back from its
other calls, and a forward over few rows costs nearly as much as one over many (a step
streams every weight whatever the batch). So when the last batches served more sessions
than are queued now, the worker holds the batch briefly (at most `gather` of the recent
batch time, and `max_wait_ms`) and starts as soon as they are all in, or as soon as the
calls queued feed `full_tokens` rows, past which a forward's cost grows with its rows
(on a CPU: `--batch-full-tokens`). It
keeps waiting while new calls keep coming (no `quiet_ms` without one: calls that piled
up in the transport while an inline batch held the event loop), or while a missing
session is *due back* before the hold ends, judged by how long it usually stays away
between two calls here. A session spending that time in the other pool's half of its
round is not waited for. (Waiting for every session of the last batches instead, the
target held batches 24–27 % of the time at 4 streams at t = 1, for 1.7–2.0 sessions a
batch; with this rule 10–11 %: `python -m benchmarks.stack_probe`.) With one active
session nobody is missing: a lone call never waits.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, Hashable, TypeVar

from specdec.task_end import end_task

# the rows past which a forward on a CPU costs about in proportion to them (`make bench`'s
# step costs, 2026-12-06 18:56 UTC: the bundled target's verification of 5 rows 1.61 ms, of
# 20 rows 5.01, of 80 rows 21.26), so a batch feeding this many is not held for company;
# by turns (benchmarks/HISTORY.md, "Holding batches") 12 made the most of 12 / 24 / 48 / none
CPU_FULL_TOKENS = 12


def full_tokens(flag: int, device_type: str) -> int:
    """--batch-full-tokens for a device: -1 (the target pool's default) picks CPU_FULL_TOKENS
    on a CPU and no limit on a GPU, whose forwards read every weight whatever their rows up
    to far larger batches."""
    if flag >= 0:
        return flag
    return CPU_FULL_TOKENS if device_type == "cpu" else 0


Job = TypeVar("Job")
Result = TypeVar("Result")


class MicroBatcher(Generic[Job, Result]):
    def __init__(self, run_batch: Callable[[list[Job]], list[Result]], max_batch: int = 64,
                 on_batch: Callable[[int, float, float], None] | None = None, key: Callable[[Job], Hashable] | None = None,
                 max_wait_ms: float = 0.0, gather: float = 0.5, size: Callable[[Job], int] | None = None,
                 inline_up_to: int = 0, quiet_ms: float = 0.5, full_tokens: int = 0) -> None:
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.on_batch = on_batch  # (sessions, engine seconds, seconds held for company)
        self.key = key  # the session a job belongs to; None: never hold a batch
        self.max_wait = max_wait_ms / 1000
        self.gather = gather
        self.size = size  # tokens a job feeds
        self.inline_up_to = inline_up_to  # batches feeding at most this many tokens run on the loop
        self.full_tokens = full_tokens  # a queue feeding this many tokens is not held (0: no such limit)
        self._recent: deque[frozenset] = deque(maxlen=2)  # sessions of the last batches
        self.quiet = quiet_ms / 1000
        self._left: dict[Hashable, float] = {}  # when each recent session's last result went out
        self._away: dict[Hashable, float] = {}  # EMA of its time between a result and its next call
        self._batch_seconds = 0.0  # moving average of a batch's engine time
        self._queue: list[tuple[Job, asyncio.Future]] = []
        self._running: frozenset = frozenset()  # the sessions of the batch running now
        self._batch_done = asyncio.Condition()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._worker: asyncio.Task | None = None
        self.busy = False

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._worker = asyncio.create_task(self._loop())

    async def submit(self, job: Job) -> Result:
        loop = asyncio.get_running_loop()
        if self.key is not None:
            k = self.key(job)
            if k in self._left:
                gap = loop.time() - self._left[k]
                self._away[k] = gap if k not in self._away else 0.5 * (self._away[k] + gap)
        fut = loop.create_future()
        self._queue.append((job, fut))
        self._wakeup.set()
        return await fut

    async def settle(self, key: Hashable, error: Exception) -> int:
        """Before a session is released: fail its queued calls with `error`, and wait for a
        batch running one of them to end; → how many were failed. A Release can overtake
        its session's last call (a pre-draft its orchestrator gave up on when the client
        went away): run after it, that call would make the session anew, and its cache
        would stay until the idle expiry (a soak's leftover, 2026-12-07)."""
        if self.key is None:
            return 0
        mine = [fut for job, fut in self._queue if self.key(job) == key]
        if mine:
            self._queue = [(job, fut) for job, fut in self._queue if self.key(job) != key]
            for fut in mine:
                if not fut.done():
                    fut.set_exception(error)
        async with self._batch_done:
            await self._batch_done.wait_for(lambda: key not in self._running)
        return len(mine)

    def _expected(self) -> frozenset:
        """Sessions the recent batches served: who is likely on the way back."""
        return frozenset().union(*self._recent)

    def _due(self, expected: frozenset, now: float, deadline: float) -> set:
        """Of the sessions expected, those due back here by the deadline: their last
        result went out less than their usual time away before it. One long overdue (by
        more than its usual time away) is busy elsewhere; one never measured counts as due."""
        due = set()
        for k in expected:
            away = self._away.get(k)
            if away is None:
                due.add(k)
                continue
            back = self._left.get(k, now) + away
            if now - away <= back <= deadline:
                due.add(k)
        return due

    async def _hold(self) -> float:
        """Wait a little for sessions of the last batches that are not queued yet;
        → the seconds waited.

        It ends as soon as everyone is in, or after `quiet` without a new call unless a
        missing session is due back before the deadline. The slices catch the
        calls that piled up in the transport while an inline batch held the event loop;
        the due rule keeps waiting for sessions about to come back, and not for those
        spending the time in the other pool's half of their round."""
        if self.key is None or self.max_wait <= 0:
            return 0.0
        expected = self._expected()
        want = min(len(expected), self.max_batch)
        queued = {self.key(job) for job, _ in self._queue}
        if len(queued) >= want or self._full():
            return 0.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + min(self.max_wait, self.gather * self._batch_seconds)
        while len(queued) < want:
            left = deadline - loop.time()
            if left <= 0:
                break
            self._wakeup.clear()
            try:  # not asyncio.wait_for: on Python 3.11 it drops a cancellation that lands with the event
                async with asyncio.timeout(min(self.quiet, left)):
                    await self._wakeup.wait()
            except TimeoutError:  # a quiet slice: only the due are worth more time
                if not self._due(expected, loop.time(), deadline) - queued:
                    break
            queued = {self.key(job) for job, _ in self._queue}
            if self._full():
                break
        return loop.time() - start

    def _full(self) -> bool:
        """Whether the calls queued already feed `full_tokens`: past about that many rows
        a forward's cost grows with its rows (its products bound by their arithmetic, not
        by reading the weights), so company saves little, and a batch started now lets the
        sessions still away form the next one while this one's answers are handled."""
        return bool(self.full_tokens and self.size is not None
                    and sum(self.size(job) for job, _ in self._queue) >= self.full_tokens)

    def _inline(self, jobs: list[Job]) -> bool:
        """A small batch runs on the event loop's own thread. In a worker thread its few
        hundred short operators would each hand the GIL back and forth with the loop,
        which is receiving the next calls meanwhile; on the loop those calls wait in the
        transport for a few milliseconds instead, and no thread hand-off is paid. A big
        batch (a long prompt's prefill) goes to the worker, so the server stays responsive."""
        return self.size is not None and sum(self.size(j) for j in jobs) <= self.inline_up_to

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                held = await self._hold()
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                live = [(job, fut) for job, fut in batch if not fut.cancelled()]
                if not live:
                    continue
                self.busy = True
                t0 = time.perf_counter()
                jobs = [j for j, _ in live]
                if self.key is not None:
                    self._running = frozenset(self.key(job) for job in jobs)
                try:
                    if self._inline(jobs):
                        results = self.run_batch(jobs)
                    else:
                        results = await loop.run_in_executor(self._executor, self.run_batch, jobs)
                except Exception as exc:  # an engine bug: fail this batch, keep serving
                    results = [exc] * len(live)
                finally:
                    self.busy = False
                    if self._running:
                        self._running = frozenset()
                        async with self._batch_done:
                            self._batch_done.notify_all()
                seconds = time.perf_counter() - t0
                self._batch_seconds = seconds if not self._batch_seconds else 0.8 * self._batch_seconds + 0.2 * seconds
                if self.key is not None:
                    self._remember(frozenset(self.key(job) for job, _ in live), loop.time())
                if self.on_batch:
                    self.on_batch(len(live), seconds, held)
                for (_, fut), res in zip(live, results):
                    if not fut.done():
                        fut.set_result(res)

    def _remember(self, served: frozenset, now: float) -> None:
        """The sessions of this batch leave now; forget those of no recent batch."""
        self._recent.append(served)
        for k in served:
            self._left[k] = now
        if len(self._left) > 4 * self.max_batch:
            keep = self._expected()
            self._left = {k: t for k, t in self._left.items() if k in keep}
            self._away = {k: a for k, a in self._away.items() if k in keep}

    async def stop(self) -> None:
        """End the worker (specdec.task_end: a stop that cancelled it once and then awaited
        it hung a draining replica for good), then the engine thread."""
        await end_task(self._worker)
        self._executor.shutdown(wait=True)
