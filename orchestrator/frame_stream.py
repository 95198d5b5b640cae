"""The orchestrator's end of a frame link (specdec.frames): a multiplexed stream to one
replica over a plain TCP or TLS connection, shaped like the grpc.aio stream call that
orchestrator.mux_link.MuxLink drives (write, read, cancel), so the link's calls, refusals,
timeouts and failures behave as on the gRPC stream.

Every failure of the connection — it cannot be opened, the replica refuses the hello,
it is cut — surfaces as the AioRpcError a gRPC stream would raise (UNAVAILABLE, or the
replica's own status at hello), so the pools' failure handling (mark the replica down,
move the session) is the same.
"""
from __future__ import annotations

import asyncio
import ssl

import grpc
from google.protobuf.message import DecodeError

from orchestrator.mux_link import CODES
from orchestrator.round_stream import rpc_error
from specdec.frames import FrameError, frame, hello, keep_alive, parse_status, read_frame

CONNECT_TIMEOUT_S = 5.0


class FrameStream:
    def __init__(self, host: str, port: int, method: str, answers_cls, name: str,
                 ssl_context: ssl.SSLContext | None = None, server_name: str | None = None) -> None:
        self.name = name  # for error messages: "target replica 10.0.0.5:50071"
        self._answers_cls = answers_cls
        self._writer: asyncio.StreamWriter | None = None
        self._connected = asyncio.ensure_future(self._connect(host, port, method, ssl_context, server_name))

    async def _connect(self, host, port, method, ssl_context, server_name):
        where = f"{self.name}'s frame link (port {port})"
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation (the link's
        # `cancel`) that lands as the connection opens, which would leave it open unowned
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=ssl_context, server_hostname=(server_name or host) if ssl_context else None)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"cannot reach {where}: {exc or 'timed out'}") from None
        self._writer = writer
        keep_alive(writer)
        try:
            writer.write(hello(method))
            await writer.drain()
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                code, details = parse_status(await read_frame(reader, limit=4096))
        except (OSError, ssl.SSLError, FrameError, asyncio.TimeoutError) as exc:
            writer.close()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{where} failed at hello: {exc or 'timed out'}") from None
        if code:
            writer.close()
            raise rpc_error(CODES.get(code, grpc.StatusCode.UNKNOWN), details)
        return reader, writer

    async def write(self, message) -> None:
        _, writer = await self._connected
        try:
            writer.write(frame(message.SerializeToString()))
            await writer.drain()
        except (OSError, ssl.SSLError) as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the link to {self.name} broke: {exc}") from None

    async def read(self):
        """The replica's next message; grpc.aio.EOF where it ended the link."""
        reader, _ = await self._connected
        try:
            payload = await read_frame(reader)
            return grpc.aio.EOF if payload is None else self._answers_cls.FromString(payload)
        except (OSError, ssl.SSLError, FrameError, DecodeError) as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the link to {self.name} broke: {exc}") from None

    def cancel(self) -> None:
        self._connected.cancel()
        if self._writer is not None:
            self._writer.close()
