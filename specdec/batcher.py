"""Continuous micro-batching for a model engine.

Calls from many sessions queue up; one worker takes *everything queued* and runs it as
one batch in a single engine thread. A lone call runs at once (nobody waits for company);
calls that arrive while a batch runs form the next batch. The model runs off the event
loop, so the gRPC server keeps answering health checks and new calls meanwhile.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

Job = TypeVar("Job")
Result = TypeVar("Result")


class MicroBatcher(Generic[Job, Result]):
    def __init__(self, run_batch: Callable[[list[Job]], list[Result]], max_batch: int = 64,
                 on_batch: Callable[[int], None] | None = None) -> None:
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.on_batch = on_batch
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

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                live = [(job, fut) for job, fut in batch if not fut.cancelled()]
                if not live:
                    continue
                self.busy = True
                try:
                    results = await loop.run_in_executor(self._executor, self.run_batch, [j for j, _ in live])
                except Exception as exc:  # an engine bug: fail this batch, keep serving
                    results = [exc] * len(live)
                finally:
                    self.busy = False
                if self.on_batch:
                    self.on_batch(len(live))
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
