"""The replica's half of a multiplexed stream (ProposeMux, VerifyMux in replica.proto).

One stream carries the calls of every session an orchestrator routes here. Per-session
streams cost each round two stream messages of their own on both sides, and on a
loaded 2-core machine those messages' handling (gRPC's poller thread, a wake-up of the
event loop, a write each) was about a quarter of the draft's and two thirds of the
orchestrator's CPU. Here the calls that arrive in one message run side by side (the
micro-batcher takes them as one batch), and the answers that are ready in the same
moment go back as one message: a batch of sessions pays for one message each way.

A call's refusal is its own answer (its status code and message), so one session's bad
call ends nothing for the others. A stopping replica refuses new calls with UNAVAILABLE,
lets the calls in flight finish and ends the stream, so the orchestrator moves each
session's next call elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from specdec.errors import SpecDecError
from specdec.grpc_server import MAX_MESSAGE_BYTES, status_of

log = logging.getLogger(__name__)
STOPPING = "the replica is stopping; call another replica of its pool"
# what one message of a multiplexed stream may carry: half the limit both ends accept, so
# that many sessions' calls (or answers) of one moment never add up to a refused message;
# one call alone may still be as large as a unary call may
MESSAGE_BUDGET = MAX_MESSAGE_BYTES // 2


def split_by_size(items: list, budget: int = MESSAGE_BUDGET) -> list[list]:
    """The items in order, in runs whose serialized sizes add up to at most `budget` (an
    item larger than that on its own is a run of its own). A lone item is one run, unsized:
    sizing a message serializes it, and at one stream every message is a lone call or
    answer, a sampled proposal's 32 KB among them."""
    if len(items) <= 1:
        return [items] if items else []
    runs, run, size = [], [], 0
    for item in items:
        n = item.ByteSize()
        if run and size + n > budget:
            runs.append(run)
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        runs.append(run)
    return runs


class AnswerWriter:
    """Gathers the answers that are ready in one turn of the event loop into one message."""

    def __init__(self, context, answers_cls) -> None:
        self._context = context
        self._answers_cls = answers_cls
        self._pending: list = []
        self._ready = asyncio.Event()
        self._closed = False
        self.task = asyncio.create_task(self._write_loop())

    def put(self, answer) -> None:
        self._pending.append(answer)
        self._ready.set()

    async def _write_loop(self) -> None:
        while not (self._closed and not self._pending):
            await self._ready.wait()
            self._ready.clear()
            await asyncio.sleep(0)  # the answers of the same batch, set in the same turn, join
            answers, self._pending = self._pending, []
            for run in split_by_size(answers):
                await self._context.write(self._answers_cls(answers=run))

    async def close(self) -> None:
        """Write what is left, then stop."""
        self._closed = True
        self._ready.set()
        await self.task


async def serve_mux(handle: Callable[[object], Awaitable[object]], request_iterator, context,
                    answer_cls, answers_cls, stopping: asyncio.Event) -> None:
    """Answer every call of the stream with `handle` (a servicer's one-call method, which
    raises SpecDecError to refuse) until the orchestrator ends the stream or the replica
    stops."""
    writer = AnswerWriter(context, answers_cls)
    running: dict[int, asyncio.Task] = {}

    async def one(call) -> None:
        try:
            answer = answer_cls(id=call.id, response=await handle(call.request))
        except SpecDecError as exc:
            answer = answer_cls(id=call.id, code=status_of(exc).value[0], details=str(exc))
        except asyncio.CancelledError:
            return  # the orchestrator gave up on it: it expects no answer
        except Exception as exc:  # a bug: refuse this call, keep the stream
            log.exception("call %d on a multiplexed stream failed", call.id)
            answer = answer_cls(id=call.id, code=grpc.StatusCode.INTERNAL.value[0], details=f"internal error: {exc}")
        finally:
            running.pop(call.id, None)
        writer.put(answer)

    async def read() -> None:
        async for message in request_iterator:
            for call in message.calls:
                if call.cancel:
                    task = running.get(call.id)
                    if task is not None:
                        task.cancel()
                elif stopping.is_set():
                    writer.put(answer_cls(id=call.id, code=grpc.StatusCode.UNAVAILABLE.value[0], details=STOPPING))
                else:
                    running[call.id] = asyncio.create_task(one(call))

    reader = asyncio.create_task(read())
    stop = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait([reader, stop], return_when=asyncio.FIRST_COMPLETED)
        if stop.done() and not reader.done():
            await asyncio.sleep(0)  # calls already read get their UNAVAILABLE answers queued
            reader.cancel()
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()
        if running:
            await asyncio.wait(list(running.values()))
        await writer.close()
    finally:
        for task in (reader, stop, writer.task, *running.values()):
            task.cancel()
