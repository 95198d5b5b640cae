"""What every gRPC server here has: health, reflection, TLS, error mapping, graceful stop."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.config import check_tls_files
from specdec.errors import (CacheMismatch, DeadlineExceeded, InvalidRequest, Overloaded, PreconditionFailed,
                            RequestSuperseded, SessionBusy, SessionNotFound, SpecDecError, Unavailable)
from specdec.task_end import end_other_tasks

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# how often a client pings an idle connection to find a dead peer; a server accepts
# pings three times as often (SPECDEC_KEEPALIVE_MS: the same on every process of a deployment)
KEEPALIVE_MS = int(os.environ.get("SPECDEC_KEEPALIVE_MS", "30000"))
# a stop still running this many seconds past its drain's grace writes the stacks of what it
# still waits on (`watch_stop`)
STOP_SLACK_S = 5.0
LEFTOVER_S = 2.0  # how long a stop's last step cancels the tasks still running (end_leftover_tasks)

STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    CacheMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    RequestSuperseded: grpc.StatusCode.FAILED_PRECONDITION,
    PreconditionFailed: grpc.StatusCode.FAILED_PRECONDITION,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SessionBusy: grpc.StatusCode.ABORTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_of(exc: SpecDecError) -> grpc.StatusCode:
    for cls, code in STATUS.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort(context: grpc.aio.ServicerContext, exc: SpecDecError):
    await context.abort(status_of(exc), str(exc))


def server_credentials(cert_file: str | None, key_file: str | None, ca_file: str | None):
    if not cert_file:
        return None
    pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    ca = Path(ca_file).read_bytes() if ca_file else None
    check_tls_files(cert_file, key_file, ca_file)
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None):
    if not ca_file:
        return None
    check_tls_files(cert_file, key_file, ca_file)
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes(),
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None)


def channel_options(server_name: str | None = None) -> list:
    """server_name: the name the pools' certificate holds, when the orchestrator dials pod
    IPs (ssl_target_name_override)."""
    extra = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return extra + [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.use_local_subchannel_pool", 1)]


class ServerShell:
    """A grpc.aio server with health and reflection, stopped gracefully on SIGTERM/SIGINT."""

    def __init__(self, service_names: list[str], interceptors=(), max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.server = grpc.aio.server(interceptors=list(interceptors), options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            # clients ping every 30 s (channel_options) to find dead peers on long-lived
            # streams; a multiplexed stream is open for good, often with no data for
            # minutes, and gRPC's default (no ping without data inside 5 minutes, two
            # strikes) would answer those pings with GOAWAY "too_many_pings" and break it
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 3),
            ("grpc.keepalive_permit_without_calls", 1)])
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        names = list(service_names) + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                       reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.stopping = asyncio.Event()

    def listen(self, host: str, port: int, credentials=None) -> int:
        """Bind the gRPC port; → the port bound. Where it cannot be bound (taken by another
        process, or a host that is not this machine's) an OSError says which, which the
        servers' start turns into one line (specdec.config.refusing_to_start)."""
        address = f"{host}:{port}"
        try:
            bound = (self.server.add_secure_port(address, credentials) if credentials
                     else self.server.add_insecure_port(address))
        except RuntimeError:  # grpcio's "Failed to bind to address ..."
            bound = 0
        if not bound:
            raise OSError(f"cannot listen on {address}: the port is taken by another process, or the host "
                          "is not an address of this machine")
        return bound

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [""] + self.service_names:
            await _maybe_await(self.health.set(name, status))

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)

    async def drain_and_stop(self, grace: float) -> None:
        """Refuse new calls, let the ones in flight finish within `grace`."""
        await self.set_serving(False)
        await self.server.stop(grace)


def watch_stop(grace: float, slack: float = STOP_SLACK_S) -> Callable[[], None]:
    """Write the stack of every thread (to stderr) and of every pending task (to the log)
    if a stop runs `slack` seconds past its drain's `grace`; → the function that ends the
    watch. A stop's steps after the drain (deregistering, the batcher's thread, closing
    Redis) have no deadline of their own, and a replica was once seen not to exit (Kubernetes
    kills it at the end of its grace period; the local stack after 15 s): this says where it
    hung. The thread dump comes from a thread of its own, so it is written even when the
    event loop itself is blocked; the tasks' stacks say what the loop awaits when it is not.
    It is a Python thread, not faulthandler's C watchdog: that one reads the other threads'
    frames without the GIL, and once crashed the process (SIGSEGV) while the loop ran."""
    after = grace + slack
    fired = threading.Timer(after, _write_threads, args=(after,))
    fired.daemon = True
    fired.name = "stop-watch"
    fired.start()
    timer = asyncio.get_running_loop().call_later(after, _log_pending_tasks, after)

    def end() -> None:
        fired.cancel()
        timer.cancel()

    return end


async def end_leftover_tasks(timeout: float = LEFTOVER_S) -> None:
    """A stop's last step: end every task still running (specdec.task_end.end_other_tasks).
    One that will not end is a bug; it is logged where it waits and the process exits 1 now,
    rather than hang in asyncio.run's own unbounded wait for it until Kubernetes kills it."""
    left = await end_other_tasks(timeout)
    if not left:
        return
    for task in left:
        log.error("task %s did not end %.0fs after being cancelled; it waits at:\n%s", task.get_name(), timeout,
                  _where(task))
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


def _write_threads(after: float) -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"the stop has run {after:.1f}s; its threads:\n"]
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        lines.append(f"\nThread {ident:#x} ({names.get(ident, '?')}, most recent call first):\n")
        lines.extend(reversed(traceback.format_stack(frame)))
    sys.stderr.write("".join(lines))
    sys.stderr.flush()


def _log_pending_tasks(after: float) -> None:
    for task in asyncio.all_tasks():
        log.warning("the stop has run %.1fs and still waits on task %s:\n%s", after, task.get_name(), _where(task))


def _where(task: asyncio.Task) -> str:
    """`awaiting(task)` as text; a dump that fails says so rather than raise, so that it
    hides neither the other tasks nor what the caller does next (an exit, at a stop's end)."""
    try:
        return "\n".join(awaiting(task))
    except Exception as exc:
        return f"  (its stack could not be read: {exc!r})"


def awaiting(task: asyncio.Task, depth: int = 64) -> list[str]:
    """Where a suspended task waits: every coroutine of its await chain at its line, the
    outermost first, then what the innermost one awaits. asyncio's `Task.print_stack` shows
    the outermost coroutine only (a suspended coroutine's frame has no caller), and under
    uvloop it failed on a frame without a line number."""
    lines, link = [], task.get_coro()
    for _ in range(depth):
        frame = next((f for f in (getattr(link, a, None) for a in ("cr_frame", "ag_frame", "gi_frame")) if f), None)
        if frame is None:
            lines.append(f"  awaiting {link!r}"[:300])
            break
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        link = next((n for n in (getattr(link, a, None) for a in ("cr_await", "ag_await", "gi_yieldfrom"))
                     if n is not None), None)
        if link is None:
            break
    return lines


async def _maybe_await(value):
    if asyncio.iscoroutine(value):
        await value
