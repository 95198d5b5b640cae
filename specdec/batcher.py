"""Continuous micro-batching for a model engine.

Calls from many sessions queue up; one worker takes *everything queued* and runs it as
one batch in a single engine thread. A lone call runs at once (nobody waits for company);
calls that arrive while a batch runs form the next batch. The model runs off the event
loop, so the gRPC server keeps answering health checks and new calls meanwhile.

Under load, sessions drift apart: each batch holds whoever happened to be back from its
other calls, and a forward over few sessions costs nearly as much as one over many (a
step streams every weight whatever the batch). So when the last batches served more
sessions than are queued now, the worker holds the batch briefly (at most `gather` of
the recent batch time, and `max_wait_ms`) for the missing ones, and starts as soon as
they are all in. With one active session that count is one: a lone call never waits.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, Hashable, TypeVar

Job = TypeVar("Job")
Result = TypeVar("Result")


class MicroBatcher(Generic[Job, Result]):
    def __init__(self, run_batch: Callable[[list[Job]], list[Result]], max_batch: int = 64,
                 on_batch: Callable[[int, float, float], None] | None = None, key: Callable[[Job], Hashable] | None = None,
                 max_wait_ms: float = 0.0, gather: float = 0.5, size: Callable[[Job], int] | None = None,
                 inline_up_to: int = 0) -> None:
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.on_batch = on_batch  # (sessions, engine seconds, seconds held for company)
        self.key = key  # the session a job belongs to; None: never hold a batch
        self.max_wait = max_wait_ms / 1000
        self.gather = gather
        self.size = size  # tokens a job feeds
        self.inline_up_to = inline_up_to  # batches feeding at most this many tokens run on the loop
        self._recent: deque[frozenset] = deque(maxlen=2)  # sessions of the last batches
        self._batch_seconds = 0.0  # moving average of a batch's engine time
        self._queue: list[tuple[Job, asyncio.Future]] = []
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
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((job, fut))
        self._wakeup.set()
        return await fut

    def _expected(self) -> int:
        """Sessions the recent batches served: who is likely on the way back."""
        return len(frozenset().union(*self._recent)) if self._recent else 0

    async def _hold(self) -> float:
        """Wait a little for sessions that were in the last batches and are not queued yet;
        → the seconds waited."""
        if self.key is None or self.max_wait <= 0:
            return 0.0
        expected = self._expected()
        queued = {self.key(job) for job, _ in self._queue}
        if len(queued) >= min(expected, self.max_batch):
            return 0.0
        wait = min(self.max_wait, self.gather * self._batch_seconds)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + wait
        while len(queued) < min(expected, self.max_batch):
            left = deadline - loop.time()
            if left <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except asyncio.TimeoutError:
                break
            queued = {self.key(job) for job, _ in self._queue}
        return loop.time() - start

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
                try:
                    if self._inline(jobs):
                        results = self.run_batch(jobs)
                    else:
                        results = await loop.run_in_executor(self._executor, self.run_batch, jobs)
                except Exception as exc:  # an engine bug: fail this batch, keep serving
                    results = [exc] * len(live)
                finally:
                    self.busy = False
                seconds = time.perf_counter() - t0
                self._batch_seconds = seconds if not self._batch_seconds else 0.8 * self._batch_seconds + 0.2 * seconds
                if self.key is not None:
                    self._recent.append(frozenset(self.key(job) for job, _ in live))
                if self.on_batch:
                    self.on_batch(len(live), seconds, held)
                for (_, fut), res in zip(live, results):
                    if not fut.done():
                        fut.set_result(res)

    async def stop(self) -> None:
        if self._worker:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
