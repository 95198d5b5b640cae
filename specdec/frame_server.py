"""The replica's frame-link listener (specdec.frames): each connection is one
multiplexed stream, answered by the same serve_mux as the gRPC ProposeMux/VerifyMux."""
from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from specdec.frames import FrameError, frame, keep_alive, read_frame, read_hello, status_frame
from specdec.mux_server import STOPPING, serve_mux

log = logging.getLogger(__name__)


@dataclass
class MuxMethod:
    """What one multiplexed method answers with: the servicer's one-call handler and the
    messages of its calls and answers."""
    handle: Callable[[object], Awaitable[object]]
    calls_cls: type
    answer_cls: type
    answers_cls: type


class _Writer:
    """serve_mux's `context`: what it writes goes out as one frame."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, message) -> None:
        self._writer.write(frame(message.SerializeToString()))
        await self._writer.drain()


async def _calls(reader: asyncio.StreamReader, calls_cls):
    while (payload := await read_frame(reader)) is not None:
        try:
            message = calls_cls.FromString(payload)
        except DecodeError as exc:
            raise FrameError(f"a frame is not a {calls_cls.__name__} message: {exc}") from None
        yield message


class FrameServer:
    def __init__(self, methods: dict[str, MuxMethod], stopping: asyncio.Event,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.methods = methods
        self.stopping = stopping
        self.ssl_context = ssl_context
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen; → the bound port (port 0 picks a free one)."""
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self.ssl_context)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        keep_alive(writer)
        try:
            method = self.methods.get(await self._hello(reader, writer))
            if method is None:
                return
            await serve_mux(method.handle, _calls(reader, method.calls_cls), _Writer(writer),
                            method.answer_cls, method.answers_cls, self.stopping)
        except (FrameError, asyncio.TimeoutError) as exc:
            log.warning("frame link from %s dropped: %s", peer, exc or "no hello in time")
        except (ConnectionError, ssl.SSLError) as exc:
            log.info("frame link from %s ended: %s", peer, exc)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """The method asked for where this replica serves it, else "" after refusing."""
        name = await read_hello(reader)
        if name not in self.methods:
            code, why = grpc.StatusCode.UNIMPLEMENTED, (f"this replica serves {', '.join(self.methods)} "
                                                        f"on its frame link, not {name!r}")
        elif self.stopping.is_set():
            code, why = grpc.StatusCode.UNAVAILABLE, STOPPING
        else:
            writer.write(status_frame())
            await writer.drain()
            return name
        writer.write(status_frame(code.value[0], why))
        await writer.drain()
        return ""

    async def stop(self, grace: float) -> None:
        """Accept no more connections; give the open ones `grace` seconds to answer their
        calls in flight (serve_mux ends each once `stopping` is set)."""
        if self._server is None:
            return
        self._server.close()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=grace)
        for task in list(self._connections):
            task.cancel()
