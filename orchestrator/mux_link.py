"""The orchestrator's half of a multiplexed stream: one stream to one replica, shared by
every generation this process runs (ProposeMux, VerifyMux in replica.proto; the replica's
half is specdec.mux_server).

The calls that sessions make in the same turn of the event loop leave as one message.
Under load that is the usual case: a batch's answers arrive as one message, wake their
sessions in the same turn, and those sessions' next calls go out together, so a batch of
sessions pays for one message each way instead of one per session.

A call behaves as on a per-generation round stream (orchestrator.round_stream): it
returns the replica's answer or raises the `AioRpcError` the unary call would have
raised, so the generation's error handling is unchanged. A refusal fails that call only;
a broken stream fails every call in flight on it with the stream's status, and the next
call opens a new stream. A caller that gives up (timeout, cancellation) sends a cancel,
so that the replica drops the work if it has not started it.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Callable

import grpc

from orchestrator.round_stream import rpc_error
from specdec import metrics
from specdec.mux_server import split_by_size

CODES = {code.value[0]: code for code in grpc.StatusCode}


class MuxLink:
    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], name: str, pool: str,
                 call_cls, calls_cls, transport: str = "grpc") -> None:
        """`open_call` opens the stream: a gRPC ProposeMux/VerifyMux call, or anything shaped
        like one (write, read → message or grpc.aio.EOF, cancel; failures as AioRpcError),
        such as a frame link's orchestrator.frame_stream.FrameStream (`transport` "frames")."""
        self._open = open_call
        self.transport = transport
        self.name = name  # for error messages: "target replica 10.0.0.5:50071"
        self._opened_metric = metrics.INTERNAL_STREAMS.labels(pool or "unknown")
        self._frames_metric = metrics.FRAME_LINKS.labels(pool or "unknown") if transport == "frames" else None
        self._messages_metric = metrics.MUX_MESSAGES.labels(pool or "unknown")
        self._calls_metric = metrics.MUX_CALLS.labels(pool or "unknown")
        self._call_cls, self._calls_cls = call_cls, calls_cls
        self._ids = itertools.count(1)
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._tasks: tuple[asyncio.Task, ...] = ()
        self._waiting: dict[int, asyncio.Future] = {}
        self._outbox: list = []
        self._kick = asyncio.Event()
        self.closed = False
        self.opened = 0  # streams opened so far
        self.messages = 0  # messages written so far (a test sees the calls share them)

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def call(self, request, timeout: float):
        """→ the replica's answer to `request`; raises AioRpcError as a unary call would."""
        if self.closed:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the stream to {self.name} is closed")
        self._ensure_open()
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        self._send(self._call_cls(id=call_id, request=request))
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            self._give_up(call_id)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{self.name} did not answer within {timeout:.1f}s") from None
        except asyncio.CancelledError:
            self._give_up(call_id)
            raise
        finally:
            self._waiting.pop(call_id, None)

    def _ensure_open(self) -> None:
        if self._stream is not None:
            return
        stream = self._stream = self._open()
        self.opened += 1
        self._opened_metric.inc()
        if self._frames_metric is not None:
            self._frames_metric.inc()
        self._outbox = []
        self._tasks = (asyncio.create_task(self._read(stream)), asyncio.create_task(self._write(stream)))

    def _send(self, call) -> None:
        self._outbox.append(call)
        self._kick.set()

    def _give_up(self, call_id: int) -> None:
        if self._stream is not None and call_id in self._waiting:
            self._send(self._call_cls(id=call_id, cancel=True))

    async def _write(self, stream: grpc.aio.StreamStreamCall) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            await asyncio.sleep(0)  # the calls other sessions make in this same turn join
            calls, self._outbox = self._outbox, []
            if not calls:
                continue
            try:
                for run in split_by_size(calls):
                    await stream.write(self._calls_cls(calls=run))
                    self.messages += 1
                    self._messages_metric.inc()
                    self._calls_metric.inc(len(run))
            except grpc.aio.AioRpcError as exc:
                self._fail(stream, exc.code(), exc.details())
                return
            except asyncio.InvalidStateError:  # the stream has ended: its reader says how
                return

    async def _read(self, stream: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                message = await stream.read()
                if message is grpc.aio.EOF:
                    self._fail(stream, grpc.StatusCode.UNAVAILABLE, f"{self.name} ended the stream")
                    return
                for answer in message.answers:
                    future = self._waiting.get(answer.id)
                    if future is None or future.done():
                        continue  # its caller gave up
                    if answer.code:
                        future.set_exception(rpc_error(CODES.get(answer.code, grpc.StatusCode.UNKNOWN),
                                                       answer.details))
                    else:
                        future.set_result(answer.response)
        except grpc.aio.AioRpcError as exc:
            self._fail(stream, exc.code(), exc.details())

    def _fail(self, stream: grpc.aio.StreamStreamCall, code: grpc.StatusCode, details: str) -> None:
        """The stream is gone: every call in flight on it fails with its status."""
        if self._stream is not stream:
            return
        self._stream = None
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        stream.cancel()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(rpc_error(code, details or f"the stream to {self.name} failed"))

    def close(self) -> None:
        """End the stream now; calls still in flight fail with UNAVAILABLE."""
        self.closed = True
        if self._stream is not None:
            self._fail(self._stream, grpc.StatusCode.UNAVAILABLE, f"the stream to {self.name} was closed")
