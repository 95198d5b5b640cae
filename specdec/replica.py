"""Hosting one engine as a pool replica: model loading, micro-batcher, registry
heartbeat, metrics and the server's life cycle. The draft and target servers differ
only in their servicer and engine; this is the part they share."""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import torch

from specdec import event_loop, metrics
from specdec.batcher import MicroBatcher, full_tokens
from specdec.config import redis_client, refusing_to_start, setup_logging
from specdec.errors import CacheMismatch, SpecDecError
from specdec.frame_server import FrameServer, MuxMethod
from specdec.frames import server_ssl_context
from specdec.gc_tuning import freeze_startup_heap
from specdec.heap_trim import HeapTrimmer
from specdec.grpc_server import ServerShell, abort, end_leftover_tasks, server_credentials, watch_stop
from specdec.internal.v1 import replica_pb2
from specdec.model_runner import ModelRunner
from specdec.models import dtype_name, load_model, pick_device, pick_dtype
from specdec.mux_server import serve_mux
from specdec.quantize import resolve as resolve_quantize
from specdec.registry import Heartbeat, ReplicaInfo, Registry

log = logging.getLogger(__name__)


def build_runner(args: argparse.Namespace, prog: str = "replica") -> ModelRunner:
    """The replica's model on its device and dtype, with its kernels chosen; a model or a
    setting it cannot serve ends the process with one line (`refusing_to_start`)."""
    setup_logging(args.log_level, args.log_format)  # before the model loads, so that its line (device, dtype) is logged
    if args.threads:
        torch.set_num_threads(args.threads)
    with refusing_to_start(prog):
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
        t0 = time.perf_counter()
        quantize = resolve_quantize(getattr(args, "quantize", "none"), device, dtype)  # a draft's option only
        runner = ModelRunner(load_model(args.model, device, dtype), linear_kernels=args.linear_kernels,
                             attention=args.attention, quantize=quantize)
        if runner.pool is not None and args.max_cache_mb > 0:  # the budget's blocks at once: no growth copies
            runner.pool.reserve(args.max_cache_mb * 2**20 // runner.pool.block_bytes)
    log.info("loaded %s on %s as %s in %.1fs; %s", args.model, device, dtype, time.perf_counter() - t0,
             runner.kernels_summary)
    return runner


class ReplicaHost:
    def __init__(self, args: argparse.Namespace, engine, run_batch, service_name: str,
                 prog: str = "replica") -> None:
        self.args = args
        self.prog = prog  # what a start-up error names (specdec.config.refusing_to_start)
        self.frame_server: FrameServer | None = None
        self.frame_port = 0  # bound, once serving
        self.engine = engine
        self.pool = args.pool
        self.address = args.advertise_address or f"127.0.0.1:{args.port}"
        self._batch_sizes = metrics.BATCH_SIZE.labels(self.pool)
        self._engine_seconds = metrics.ENGINE_SECONDS.labels(self.pool)
        self._held_seconds = metrics.BATCH_HOLD_SECONDS.labels(self.pool)
        self._evictions = metrics.EVICTIONS.labels(self.pool)
        self._evictions_seen = 0
        self._reuses = metrics.PREFIX_REUSES.labels(self.pool), metrics.REUSED_POSITIONS.labels(self.pool)
        self._reuses_seen = (0, 0)
        self.batcher = MicroBatcher(run_batch, max_batch=args.max_batch, on_batch=self._on_batch,
                                    key=lambda job: job.ref.session_id, max_wait_ms=args.batch_wait_ms,
                                    size=lambda job: job.forward_size, inline_up_to=args.inline_tokens,
                                    full_tokens=full_tokens(args.batch_full_tokens, engine.runner.device.type))
        self.shell = ServerShell([service_name])
        self.redis = redis_client(args.redis_url, args.redis_password_file)
        self.heartbeat = Heartbeat(Registry(self.redis), self.info)
        self.heap_trim = HeapTrimmer(getattr(args, "heap_trim_seconds", 0))

    @property
    def draining(self) -> bool:
        """Stopping: calls in flight finish, round streams end after their current message."""
        return self.shell.stopping.is_set()

    async def answer(self, handle, request, context):
        """A unary call: `handle`'s answer, or its refusal as the matching gRPC status."""
        try:
            return await handle(request)
        except SpecDecError as exc:
            await abort(context, exc)

    async def answer_stream(self, handle, request_iterator, context):
        """A round stream: each request answered in order; a refusal ends the stream with the
        status the unary call would have had; a stopping replica ends it between two rounds,
        so that the session's next call moves to another replica."""
        async for request in request_iterator:
            yield await self.answer(handle, request, context)
            if self.draining:
                return

    async def answer_mux(self, handle, request_iterator, context, answer_cls, answers_cls) -> None:
        """A multiplexed stream: many sessions' calls, each answered or refused on its own
        (specdec.mux_server)."""
        await serve_mux(handle, request_iterator, context, answer_cls, answers_cls, self.shell.stopping)

    async def _start_frame_link(self, methods: dict[str, MuxMethod]) -> None:
        port = getattr(self.args, "frame_port", -1)
        if port < 0 or not methods:
            return
        ssl_context = server_ssl_context(self.args.tls_cert_file, self.args.tls_key_file, self.args.tls_ca_file)
        self.frame_server = FrameServer(methods, self.shell.stopping, ssl_context)
        self.frame_port = await self.frame_server.start(self.args.host, port)

    def _on_batch(self, size: int, seconds: float, held: float) -> None:
        # per batch only pre-bound children; the session and cache gauges, a walk over
        # every session, follow the heartbeat in info()
        self._batch_sizes.observe(size)
        self._engine_seconds.observe(seconds)
        if held > 0:
            self._held_seconds.observe(held)
        table = self.engine.sessions
        if table.evictions > self._evictions_seen:
            self._evictions.inc(table.evictions - self._evictions_seen)
            self._evictions_seen = table.evictions
        reuses = (table.prefix_reuses, table.reused_positions)
        if reuses != self._reuses_seen:
            for counter, now, seen in zip(self._reuses, reuses, self._reuses_seen):
                counter.inc(now - seen)
            self._reuses_seen = reuses

    def _expire_idle(self) -> None:
        """Sessions idle past --session-idle-seconds released, then the freed heap trimmed
        (--heap-trim-seconds, specdec/heap_trim.py), on the event loop between two batches: a
        batch on the worker thread may be using the table (`busy`)."""
        limit = getattr(self.args, "session_idle_seconds", 0)
        if self.batcher.busy:
            return
        if limit > 0:
            n = self.engine.sessions.expire_idle(limit)
            if n:
                metrics.EXPIRED.labels(self.pool).inc(n)
                log.info("released %d session(s) idle for more than %.0fs", n, limit)
        trims = self.heap_trim.seconds
        if self.heap_trim.maybe_trim():  # after the releases, whose caches it can then give back
            metrics.HEAP_TRIM_SECONDS.labels(self.pool).observe(self.heap_trim.seconds - trims)

    def info(self) -> ReplicaInfo:
        """The load this replica reports to the registry (every heartbeat, which first
        releases the sessions idle too long); the gauges too."""
        self._expire_idle()
        s = self.engine.sessions
        metrics.REPLICA_SESSIONS.labels(self.pool).set(len(s))
        metrics.REPLICA_CACHE_BYTES.labels(self.pool).set(s.cache_bytes)
        if self.engine.runner.pool is not None:
            metrics.CACHE_POOL_BYTES.labels(self.pool).set(self.engine.runner.pool.nbytes)
        metrics.REPLICA_QUEUE.labels(self.pool).set(self.batcher.queue_length)
        return ReplicaInfo(address=self.address, pool=self.pool, capacity=s.max_sessions, sessions=len(s),
                           queue_length=self.batcher.queue_length, cache_bytes=s.cache_bytes,
                           model=str(self.args.model), vocab_size=self.engine.runner.vocab_size,
                           dtype=dtype_name(self.engine.runner.dtype), kernels=self.engine.runner.kernels_summary,
                           frame_port=self.frame_port)

    async def release(self, session_id: str) -> bool:
        """Release a session's cache once no call of it is queued or running (`settle`);
        → whether the replica held it."""
        await self.batcher.settle(session_id, CacheMismatch(
            f"session {session_id} was released while this call waited its turn"))
        return self.engine.release(session_id)

    def load_report(self) -> replica_pb2.LoadReport:
        s = self.engine.sessions
        return replica_pb2.LoadReport(
            pool=self.pool, address=self.address, sessions=len(s), cache_bytes=s.cache_bytes,
            queue_length=self.batcher.queue_length, max_sessions=s.max_sessions,
            prefill_tokens=self.engine.fed_tokens, forward_passes=self.engine.forward_passes,
            evictions=s.evictions, model=str(self.args.model), vocab_size=self.engine.runner.vocab_size)

    async def serve(self, add_servicer, frame_methods: dict[str, MuxMethod] | None = None) -> None:
        """Serve until SIGTERM; `frame_methods`: the multiplexed methods the frame link
        answers (specdec.frames), by name."""
        add_servicer(self.shell.server)
        with refusing_to_start(self.prog):  # a port taken: gRPC's or the metrics'
            creds = server_credentials(self.args.tls_cert_file, self.args.tls_key_file, self.args.tls_ca_file)
            port = self.shell.listen(self.args.host, self.args.port, creds)
            metrics.serve_metrics(self.args.metrics_port)
        self.batcher.start()
        with refusing_to_start(self.prog):  # the frame link's (a fixed --frame-port)
            await self._start_frame_link(frame_methods or {})
        log.info("froze %d start-up objects out of garbage collection", freeze_startup_heap())
        await self.shell.server.start()
        await self.shell.set_serving(True)
        self.heartbeat.start()
        self.shell.install_signal_handlers()
        log.info("%s replica serving on %s:%d (advertised as %s)%s; event loop %s", self.pool, self.args.host, port,
                 self.address, f", frame link on port {self.frame_port}" if self.frame_port else "",
                 event_loop.running())
        await self.shell.stopping.wait()
        log.info("draining: deregistering and finishing calls in flight (up to %.0fs)", self.args.drain_seconds)
        end_watch = watch_stop(self.args.drain_seconds)
        await self.heartbeat.stop()
        if self.frame_server is not None:
            await asyncio.gather(self.shell.drain_and_stop(self.args.drain_seconds),
                                 self.frame_server.stop(self.args.drain_seconds))
        else:
            await self.shell.drain_and_stop(self.args.drain_seconds)
        await self.batcher.stop()
        await self.redis.aclose()
        await end_leftover_tasks()
        end_watch()
        log.info("stopped")
