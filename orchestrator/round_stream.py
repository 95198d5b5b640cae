"""One generation's bidirectional stream to one replica: a request, then its answer.

A unary call pays its set-up (a new HTTP/2 stream, headers, trailers, a completion for
each) on every round; a message on an open stream does not. On this 2-core VM a Verify
round trip costs about 0.55 ms less that way (`python -m benchmarks.rpc_floor`), two
hops a round. The stream opens on the first call and serves the whole generation.

Any failure — the replica refusing a request (the stream ends with the unary call's
status), a timeout, a cancelled caller — drops the stream and raises an
`AioRpcError`, so the caller's error handling is the unary call's; the next call opens
a fresh stream. Calls are answered strictly in order, one at a time.
"""
from __future__ import annotations

import asyncio
from typing import Callable

import grpc

from specdec import metrics


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RoundStream:
    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], name: str, pool: str = "") -> None:
        self._open = open_call
        self.name = name  # for error messages: "target replica 10.0.0.5:50071"
        self._opened_metric = metrics.INTERNAL_STREAMS.labels(pool or "unknown")
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()
        self.opened = 0  # streams opened so far (a test sees reuse)

    async def call(self, request, timeout: float):
        """→ the replica's answer to `request`; raises AioRpcError as a unary call would."""
        async with self._lock:
            call = self._call
            if call is None or call.done():
                call = self._call = self._open()
                self.opened += 1
                self._opened_metric.inc()
            try:
                async with asyncio.timeout(timeout):
                    await call.write(request)
                    response = await call.read()
            except TimeoutError:
                self._drop()
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"{self.name} did not answer within {timeout:.1f}s") from None
            except asyncio.InvalidStateError:  # the stream ended between two calls
                self._drop()
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the stream to {self.name} ended") from None
            except BaseException:  # AioRpcError, or the caller cancelled mid-call
                self._drop()
                raise
            if response is grpc.aio.EOF:
                self._drop()
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.name} closed the stream")
            return response

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        """End the stream cleanly (the replica's handler returns); waits for any call in flight."""
        async with self._lock:
            call, self._call = self._call, None
            if call is not None and not call.done():
                try:
                    await call.done_writing()
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    call.cancel()


CALL_MODES = ("frames", "mux", "stream", "unary")


class SessionLinks:
    """A generation's calls to the pools, in one of four ways (`mode`):
    - "mux": over the process's one shared stream per replica (orchestrator.mux_link),
      one call at a time per replica for this generation, except calls that need no
      order (`ordered` False: a fork drafts in a private copy of the cache, so it can go
      in the same message as the pre-draft beside it);
    - "frames": as "mux", the shared stream going over the replica's frame link
      (specdec.frames) where it has one (the pools were built with `frames`);
    - "stream": over one RoundStream per replica of its own;
    - "unary": as plain unary calls (e.g. behind a proxy that dislikes long streams)."""

    def __init__(self, pools, mode: str = "mux") -> None:
        if mode not in CALL_MODES:
            raise ValueError(f"internal call mode must be one of {CALL_MODES}, got {mode!r}")
        self.pools = pools
        self.mode = mode
        self._open: dict[tuple[str, str], RoundStream] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def _stream(self, kind: str, address: str) -> RoundStream:
        link = self._open.get((kind, address))
        if link is None:
            # the stub is looked up at each opening: a replica marked down gets a new channel
            if kind == "draft":
                opener = lambda: self.pools.draft(address).ProposeStream()  # noqa: E731
            else:
                opener = lambda: self.pools.target(address).VerifyStream()  # noqa: E731
            link = self._open[(kind, address)] = RoundStream(opener, f"{kind} replica {address}", kind)
        return link

    async def _call(self, kind: str, address: str, request, timeout: float, ordered: bool = True):
        if self.mode == "stream":
            return await self._stream(kind, address).call(request, timeout)
        if self.mode == "unary":
            unary = self.pools.draft(address).Propose if kind == "draft" else self.pools.target(address).Verify
            return await unary(request, timeout=timeout)
        if not ordered:
            return await (await self.pools.shared_link(kind, address)).call(request, timeout)
        lock = self._locks.get((kind, address))
        if lock is None:
            lock = self._locks[(kind, address)] = asyncio.Lock()
        async with lock:  # in order, as on a stream of its own: a pre-draft, then the next call
            return await (await self.pools.shared_link(kind, address)).call(request, timeout)

    async def propose(self, address: str, request, timeout: float, ordered: bool = True):
        return await self._call("draft", address, request, timeout, ordered)

    async def verify(self, address: str, request, timeout: float):
        return await self._call("target", address, request, timeout)

    @property
    def opened(self) -> int:
        """Streams of its own this generation opened ("stream" mode)."""
        return sum(link.opened for link in self._open.values())

    async def close(self) -> None:
        links, self._open = list(self._open.values()), {}
        await asyncio.gather(*(link.close() for link in links))
