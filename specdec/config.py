"""Command-line flags shared by the three servers; every flag also reads SPECDEC_<NAME>."""
from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
from datetime import datetime, timezone
from contextlib import contextmanager
from pathlib import Path

from specdec.batcher import CPU_FULL_TOKENS
from specdec.event_loop import CHOICES as EVENT_LOOPS


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def env(name: str, default=None):
    return os.environ.get("SPECDEC_" + name, default)


# the servers' numeric flags and their ranges [low, high): outside them a server would
# start and then misbehave (no batch ever run, every call refused) or fail deep in
# start-up with a traceback. A flag a server lacks is skipped.
INF = float("inf")
RANGES = (
    ("session_idle_seconds", 0, INF, "a finite number of seconds, 0 (never) or more"),
    ("heap_trim_seconds", 0, INF, "a finite number of seconds, 0 (never) or more"),
    ("threads", 0, INF, "a number of threads, 0 (torch's default) or more"),
    ("max_sessions", 1, INF, "a number of sessions, 1 or more"),
    ("max_batch", 1, INF, "a number of sessions, 1 or more"),
    ("max_cache_mb", 0, INF, "a number of MiB, 0 (no limit) or more"),
    ("batch_wait_ms", 0, INF, "a finite number of milliseconds, 0 (never hold) or more"),
    ("inline_tokens", 0, INF, "a number of tokens, 0 (always a worker) or more"),
    ("drain_seconds", 0, INF, "a finite number of seconds, 0 or more"),
    ("port", 0, 65536, "a port number, 0 (a free one) to 65535"),
    ("metrics_port", 0, 65536, "a port number, 0 (off) to 65535"),
    ("frame_port", -1, 65536, "a port number, 0 (a free one) to 65535, or -1 (none)"),
    ("batch_full_tokens", -1, INF, "a number of tokens, 0 (no limit) or -1 (by device)"),
    ("max_context", 0, INF, "0 or more"),  # the orchestrator's
    ("max_new_tokens", 1, INF, "1 or more"),
    ("max_concurrent", 1, INF, "1 or more"),
    ("overlap_min_hit", 0, INF, "a finite chance, 0 or more (above 1: never)"),
)


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`ap.parse_args`, and a flag with choices whose value came from its SPECDEC_ variable
    checked as argparse checks a command-line value (argparse never checks defaults): a
    mistyped setting in a manifest is a usage error naming the variable, not a traceback
    from deep in start-up."""
    args = ap.parse_args(argv)
    for dest, low, high, meaning in RANGES:
        value = getattr(args, dest, None)
        if value is not None and not low <= value < high:
            ap.error(f"--{dest.replace('_', '-')} must be {meaning}, got {value}")
    for action in ap._actions:  # argparse keeps no public list of a parser's flags
        value = getattr(args, action.dest, None)
        if action.choices is None or value is None or value in action.choices or value != action.default:
            continue
        name = "SPECDEC_" + action.dest.upper()
        ap.error(f"{name}={value!r} is not a choice of {action.option_strings[0]} "
                 f"({', '.join(map(str, action.choices))})")
    return args


@contextmanager
def refusing_to_start(prog: str):
    """What goes wrong while a server starts because of how it was configured (a model or
    tokenizer that cannot load, kernels or a quantisation this machine cannot run, a secret
    or certificate file that cannot be read, a device this machine lacks or whose memory
    the model does not fit) ends the process with one line naming the problem, status 1,
    rather than a traceback."""
    from specdec.model_files import ModelLoadError

    try:
        yield
    except Exception as exc:
        torch = sys.modules.get("torch")  # the orchestrator runs without it (orchestrator/__main__.py)
        if torch is not None and isinstance(exc, torch.OutOfMemoryError):
            raise SystemExit(f"{prog}: cannot start: out of device memory while loading: {exc}") from None
        if isinstance(exc, (ModelLoadError, ValueError, OSError)):
            raise SystemExit(f"{prog}: cannot start: {exc}") from None
        raise


def read_secret(path: str | None) -> str | None:
    """Secrets come from files (Kubernetes Secrets) and are never logged."""
    if not path:
        return None
    return Path(path).read_text().strip()


def add_common_args(ap: argparse.ArgumentParser, default_port: int) -> None:
    ap.add_argument("--host", default=env("HOST", "0.0.0.0"), help="listen address [SPECDEC_HOST]")
    ap.add_argument("--port", type=int, default=int(env("PORT", default_port)), help=f"gRPC port (default {default_port}) [SPECDEC_PORT]")
    ap.add_argument("--redis-url", default=env("REDIS_URL", "redis://127.0.0.1:6379/0"),
                    help="Redis URL [SPECDEC_REDIS_URL]")
    ap.add_argument("--redis-password-file", default=env("REDIS_PASSWORD_FILE"),
                    help="file holding the Redis password [SPECDEC_REDIS_PASSWORD_FILE]")
    ap.add_argument("--metrics-port", type=int, default=int(env("METRICS_PORT", 0)),
                    help="Prometheus /metrics port, 0 = off [SPECDEC_METRICS_PORT]")
    ap.add_argument("--drain-seconds", type=float, default=float(env("DRAIN_SECONDS", 20)),
                    help="on SIGTERM, time given to calls in flight [SPECDEC_DRAIN_SECONDS]")
    ap.add_argument("--tls-cert-file", default=env("TLS_CERT_FILE"), help="server certificate (PEM) [SPECDEC_TLS_CERT_FILE]")
    ap.add_argument("--tls-key-file", default=env("TLS_KEY_FILE"), help="server key (PEM) [SPECDEC_TLS_KEY_FILE]")
    ap.add_argument("--tls-ca-file", default=env("TLS_CA_FILE"),
                    help="CA (PEM): servers require client certificates signed by it (mutual TLS); "
                         "clients verify servers with it [SPECDEC_TLS_CA_FILE]")
    ap.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=env("LOG_LEVEL", "INFO").upper(),
                    help="DEBUG, INFO (default), WARNING, ERROR or CRITICAL, any case [SPECDEC_LOG_LEVEL]")
    ap.add_argument("--log-format", choices=("text", "json"), default=env("LOG_FORMAT", "text"),
                    help="text (default) or json: one JSON object a line (time, level, logger, message, and "
                         "the traceback where there is one), for a log collector [SPECDEC_LOG_FORMAT]")
    ap.add_argument("--event-loop", choices=EVENT_LOOPS, default=env("EVENT_LOOP", "auto"),
                    help="auto (uvloop where installed, else asyncio's), uvloop or asyncio: the internal calls' "
                         "sockets are served by it (specdec/event_loop.py) [SPECDEC_EVENT_LOOP]")


def add_replica_args(ap: argparse.ArgumentParser, pool: str, default_model: str) -> None:
    ap.add_argument("--model", default=env("MODEL", default_model),
                    help=f"model directory or Hugging Face id (default: the bundled {pool}) [SPECDEC_MODEL]")
    ap.add_argument("--pool", default=env("POOL", pool), help=f"pool name (default {pool}) [SPECDEC_POOL]")
    ap.add_argument("--advertise-address", default=env("ADVERTISE_ADDRESS"),
                    help="host:port registered in Redis (default 127.0.0.1:<port>) [SPECDEC_ADVERTISE_ADDRESS]")
    ap.add_argument("--frame-port", type=int, default=int(env("FRAME_PORT", 0)),
                    help="port of the frame link: the multiplexed calls over plain TCP, or TLS with the same "
                         "certificates as the gRPC port, for orchestrators run with --internal-calls frames "
                         "(specdec/frames.py); 0 = a free port, registered in Redis; -1 = none [SPECDEC_FRAME_PORT]")
    ap.add_argument("--device", default=env("DEVICE", "auto"), help="auto|cpu|cuda[:N] [SPECDEC_DEVICE]")
    ap.add_argument("--dtype", default=env("DTYPE", "auto"),
                    help="auto (fp32 on CPU, bf16 on GPU)|float32|bfloat16|float16 [SPECDEC_DTYPE]")
    ap.add_argument("--linear-kernels", choices=("auto", "aten", "onednn", "half"), default=env("LINEAR_KERNELS", "auto"),
                    help="matrix products on a CPU: auto (time the kernels this machine has at start and keep "
                         "one for every row count: the batch-invariant half unless another is clearly faster; "
                         "specdec/linear_kernels.py), aten (F.linear: MKL), onednn (packed once), half "
                         "(16-bit weights where that loses nothing); a GPU always uses F.linear under auto "
                         "[SPECDEC_LINEAR_KERNELS]")
    ap.add_argument("--attention", choices=("auto", "native", "sdpa", "paged"), default=env("ATTENTION", "auto"),
                    help="auto (native on a CPU in float32, paged on a GPU, else sdpa), native (every "
                         "session's attention of a layer in one C++ call), sdpa (torch's, per session) or "
                         "paged (the sessions' caches in blocks of one pool, shared by prefix reuse, and a "
                         "few calls a layer for a whole batch; with --max-cache-mb the pool is that size "
                         "from the start) [SPECDEC_ATTENTION]")
    ap.add_argument("--max-sessions", type=int, default=int(env("MAX_SESSIONS", 256)),
                    help="sessions held before LRU eviction of idle ones [SPECDEC_MAX_SESSIONS]")
    ap.add_argument("--session-idle-seconds", type=float, default=float(env("SESSION_IDLE_SECONDS", 600)),
                    help="release a session's cache once it has been idle this long (default 600, the "
                         "orchestrators' --session-ttl: by then its handle has expired and no call can "
                         "continue it; what an orchestrator that died, or a lost Release, leaves behind); "
                         "0 = never [SPECDEC_SESSION_IDLE_SECONDS]")
    ap.add_argument("--heap-trim-seconds", type=float, default=float(env("HEAP_TRIM_SECONDS", 30)),
                    help="give the memory the C allocator holds freed back to the system (glibc's "
                         "malloc_trim, a few ms) at most this often, between batches (default 30); 0 = never "
                         "[SPECDEC_HEAP_TRIM_SECONDS]")
    ap.add_argument("--max-cache-mb", type=int, default=int(env("MAX_CACHE_MB", 0)),
                    help="KV-cache MiB held before eviction, checked as sessions are created and as their "
                         "caches grow: released prefix donors go first, then the least recently used idle "
                         "sessions (their next call rebuilds); 0 = no limit [SPECDEC_MAX_CACHE_MB]")
    ap.add_argument("--prefix-reuse", choices=("on", "off"), default=env("PREFIX_REUSE", "on"),
                    help="on: a new session whose first tokens (at least 16) another held session's cache "
                         "holds starts from a copy of them instead of computing them again (a shared system "
                         "prompt, a prompt asked again); off: every session prefills its whole prompt "
                         "[SPECDEC_PREFIX_REUSE]")
    ap.add_argument("--max-batch", type=int, default=int(env("MAX_BATCH", 64)), help="sessions per engine batch [SPECDEC_MAX_BATCH]")
    ap.add_argument("--batch-wait-ms", type=float, default=float(env("BATCH_WAIT_MS", 5.0)),
                    help="under load, hold a batch up to this long (and half the recent batch time) for "
                         "sessions of the last batches that are due back; 0 = never hold; a lone session "
                         "never waits [SPECDEC_BATCH_WAIT_MS]")
    # the target's forward has a row per token; a draft step has one per session, and its
    # cost grows far slower with them (make bench: 0.17 ms for 1, 0.60 for 16), so company pays
    full_default = -1 if pool == "target" else 0
    ap.add_argument("--batch-full-tokens", type=int, default=int(env("BATCH_FULL_TOKENS", full_default)),
                    help="a batch whose calls already feed this many tokens is not held for company: past "
                         "about that many rows a forward's cost grows with its rows, so company saves little; "
                         f"0 = no such limit; -1 = {CPU_FULL_TOKENS} on a CPU, no limit on a GPU (default "
                         f"{full_default}) [SPECDEC_BATCH_FULL_TOKENS]")
    ap.add_argument("--inline-tokens", type=int, default=int(env("INLINE_TOKENS", 256)),
                    help="batches feeding at most this many tokens run on the server's event loop "
                         "thread instead of a worker thread (default 256); 0 = always a worker [SPECDEC_INLINE_TOKENS]")
    ap.add_argument("--threads", type=int, default=int(env("THREADS", 0)), help="torch CPU threads, 0 = torch default [SPECDEC_THREADS]")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record, so that a log collector (Loki, Elasticsearch, Cloud
    Logging) takes the level and the logger as fields instead of parsing text."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        for key, value in getattr(record, "fields", {}).items():  # a record's own facts (orchestrator/access_log.py)
            entry.setdefault(key, value)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def check_start_settings(args: argparse.Namespace) -> None:
    """A Redis URL that redis-py cannot parse, a password file that cannot be read, or TLS
    files that are not a PEM certificate and key end a replica's start at once: it met them
    after its model loaded (minutes, for a large one on a GPU). Nothing connects here: Redis
    may come up later."""
    from redis.connection import parse_url

    parse_url(args.redis_url)  # a ValueError naming the schemes it takes
    read_secret(args.redis_password_file)
    if args.tls_cert_file:
        check_tls_files(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)


def check_tls_files(cert_file: str | None, key_file: str | None, ca_file: str | None) -> None:
    """A ValueError naming the file where the certificate and key are not a PEM pair, or the
    CA file holds no PEM certificate (a server's or a client's). grpcio takes any bytes as
    credentials and fails only as a server's port is bound ("failed to bind", which reads as
    a port taken) or as a channel's first call shakes hands."""
    for path in (cert_file, key_file, ca_file):
        if path:
            open(path, "rb").close()  # an OSError that names the file (ssl's name none)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        if cert_file:
            ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ValueError(f"the TLS certificate {cert_file} and key {key_file} are not a PEM certificate "
                         f"and its private key ({exc.reason or exc})") from None
    if ca_file:
        try:
            ctx.load_verify_locations(ca_file)
        except ssl.SSLError as exc:
            raise ValueError(f"the TLS CA file {ca_file} holds no PEM certificate ({exc.reason or exc})") from None


def redis_client(url: str, password_file: str | None):
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError

    password = read_secret(password_file) or env("REDIS_PASSWORD")
    # one quick retry on a fresh connection: after a Redis restart the pooled connections
    # are dead, and the first command on each would otherwise fail although Redis is back
    retry = Retry(ExponentialBackoff(cap=0.1, base=0.02), 1, supported_errors=(ConnectionError,))
    return aioredis.from_url(url, password=password, socket_connect_timeout=1.0, socket_timeout=2.0,
                             health_check_interval=10, retry=retry)
