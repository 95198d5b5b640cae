"""Prometheus metrics of every process (exported on --metrics-port at /metrics)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)

# replicas
REPLICA_SESSIONS = Gauge("specdec_replica_sessions", "Sessions whose KV cache this replica holds", ["pool"])
REPLICA_CACHE_BYTES = Gauge("specdec_replica_cache_bytes", "Bytes of KV cache held", ["pool"])
CACHE_POOL_BYTES = Gauge("specdec_replica_cache_pool_bytes",
                         "Bytes of the paged caches' pool, held whether its blocks are in use or free", ["pool"])
REPLICA_QUEUE = Gauge("specdec_replica_queue_length", "Calls waiting for the engine", ["pool"])
BATCH_SIZE = Histogram("specdec_batch_size", "Sessions per engine batch", ["pool"],
                       buckets=(1, 2, 4, 8, 16, 32, 64))
ENGINE_SECONDS = Histogram("specdec_engine_seconds", "Engine time per batch", ["pool"], buckets=LATENCY_BUCKETS)
BATCH_HOLD_SECONDS = Histogram("specdec_batch_hold_seconds",
                               "Time a batch was held for sessions of the last batches (held batches only)",
                               ["pool"], buckets=LATENCY_BUCKETS)
EVICTIONS = Counter("specdec_replica_evictions_total", "Idle sessions evicted (LRU)", ["pool"])
PREFIX_REUSES = Counter("specdec_replica_prefix_reuses_total",
                        "New sessions started from a copy of another held session's prefix (--prefix-reuse)", ["pool"])
REUSED_POSITIONS = Counter("specdec_replica_reused_positions_total",
                           "Prompt positions copied from another session's cache instead of computed", ["pool"])
EXPIRED = Counter("specdec_replica_sessions_expired_total",
                  "Sessions released after --session-idle-seconds without a call", ["pool"])
HEAP_TRIM_SECONDS = Histogram("specdec_replica_heap_trim_seconds",
                              "Each trim of the freed heap (--heap-trim-seconds, malloc_trim)", ["pool"],
                              buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))

# orchestrator
REQUESTS = Counter("specdec_requests_total", "Generation requests by outcome", ["method", "code"])
REQUEST_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
REQUEST_SECONDS = Histogram("specdec_request_seconds", "Wall time of generation requests that succeeded",
                            ["method"], buckets=REQUEST_BUCKETS)
FIRST_TOKEN_SECONDS = Histogram("specdec_time_to_first_token_seconds",
                                "From a stream's arrival to its first chunk of tokens (GenerateStream)",
                                buckets=REQUEST_BUCKETS)
TOKEN_SECONDS = Histogram("specdec_time_per_output_token_seconds",
                          "Per request of two tokens or more: the time after its first token, per later token",
                          ["method"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1))
TOKENS = Counter("specdec_generated_tokens_total", "Tokens generated")
ROUNDS = Counter("specdec_rounds_total", "Speculation rounds")
DRAFTED = Counter("specdec_drafted_tokens_total", "Draft tokens proposed")
ACCEPTED = Counter("specdec_accepted_tokens_total", "Draft tokens accepted")
LOOKUP_DRAFTED = Counter("specdec_lookup_drafted_tokens_total",
                         "Tokens proposed by prompt lookup for greedy sessions no draft replica served")
LOOKUP_ACCEPTED = Counter("specdec_lookup_accepted_tokens_total", "Of those, tokens the target kept")
ACCEPTED_LENGTH = Histogram("specdec_accepted_length", "Draft tokens accepted per round",
                            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16))
ACCEPT_AT_POSITION = Counter("specdec_accepted_at_position_total",
                             "Rounds whose draft token at this position was accepted", ["position"])
DRAFTED_AT_POSITION = Counter("specdec_drafted_at_position_total",
                              "Rounds that drafted a token at this position", ["position"])
_POSITION_CHILDREN: dict[tuple[int, int], object] = {}


def at_position(counter: Counter, position: int):
    """`counter.labels(str(position))`, looked up once: a round counts γ positions or more,
    and `labels()` (string keys, validation, a lock) costs several times the increment."""
    key = (id(counter), position)
    child = _POSITION_CHILDREN.get(key)
    if child is None:
        child = _POSITION_CHILDREN[key] = counter.labels(str(position))
    return child


GAMMA = Histogram("specdec_gamma", "Speculation length chosen per round", buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16))
STAGE_SECONDS = Histogram("specdec_stage_seconds", "Time per round stage", ["stage"], buckets=LATENCY_BUCKETS)
DRAFT_STAGE, VERIFY_STAGE = STAGE_SECONDS.labels("draft"), STAGE_SECONDS.labels("verify")  # observed every round
ACTIVE_SESSIONS = Gauge("specdec_active_generations", "Generations in flight")
OVERLAP = Counter("specdec_overlap_total", "Pre-drafted rounds: attempts and hits; forks started and used", ["outcome"])
DRAFT_STOPS = Counter("specdec_draft_stops_total",
                      "Proposals the draft ended before the γ asked, at a token it was unsure of (stop_below)")
DRAFT_LATE = Counter("specdec_draft_late_total",
                     "Draft calls not answered within --draft-wait-ms: the round went on target-only, and the "
                     "session made no draft call until that one ended")
INTERNAL_STREAMS = Counter("specdec_internal_streams_opened_total",
                           "Streams opened to the pools (round streams: one per generation and replica; "
                           "multiplexed: one per replica; more after errors)", ["pool"])
FRAME_LINKS = Counter("specdec_frame_links_opened_total",
                      "Of those multiplexed streams, the ones opened over a replica's frame link (TCP or TLS "
                      "without gRPC, --internal-calls frames); the rest went over gRPC", ["pool"])
MUX_MESSAGES = Counter("specdec_mux_messages_total",
                       "Messages written on the multiplexed streams to the pools", ["pool"])
MUX_CALLS = Counter("specdec_mux_calls_total",
                    "Calls sent on the multiplexed streams to the pools (÷ messages: calls per message)", ["pool"])
REDIS_COMMIT_BATCH = Histogram("specdec_redis_commit_batch_size",
                               "Round commits sent to Redis in one write (the commits of one event-loop turn)",
                               buckets=(1, 2, 4, 8, 16, 32, 64))
FAILOVERS = Counter("specdec_replica_failovers_total", "Sessions re-homed after a replica failed", ["pool"])
SESSION_CONFLICTS = Counter("specdec_session_conflicts_total",
                            "Calls that found their session held by another call: refused at the start "
                            "(in_use) or at a round's commit, after their lease lapsed (taken_over)", ["reason"])
REQUESTS_RESUMED = Counter("specdec_requests_resumed_total",
                           "Calls that carried the request_id of an earlier call: continued where its attempts "
                           "stopped (continued), or answered with what they committed, already whole (answered)",
                           ["how"])
SESSIONS_REAPED = Counter("specdec_sessions_reaped_total",
                          "Sessions released in the background (orchestrator/reaper.py): a call's whose "
                          "orchestrator died, caches and handle (orchestrator_died); a cut answer's kept for a "
                          "retry that did not come within --retry-window, caches only (retry_window)", ["reason"])
HANDLES_REWRITTEN = Counter("specdec_session_handles_rewritten_total",
                            "Session handles gone from Redis at a round's commit (Redis lost writes) and "
                            "written again whole by the call holding the session")

# every process
GC_PAUSE_SECONDS = Histogram("specdec_gc_pause_seconds", "Pause of each cyclic garbage collection", ["generation"],
                             buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5))
GC_FROZEN_OBJECTS = Gauge("specdec_gc_frozen_objects",
                          "Objects loaded at start-up and exempted from garbage collection (gc.freeze)")


class _TableGauge:
    """A gauge family read at scrape time from state the process keeps anyway, so the hot
    path copies nothing into a metric."""

    def __init__(self, name: str, doc: str, label: str, read: Callable[[], dict]) -> None:
        self.name, self.doc, self.label, self.read = name, doc, label, read

    def collect(self):
        family = GaugeMetricFamily(self.name, self.doc, labels=[self.label])
        for key, value in self.read().items():
            family.add_metric([str(key)], value)
        yield family


def export_target_forward_ms(read: Callable[[], dict]) -> None:
    """specdec_target_forward_ms{rows}: the γ policy's measured forward times, `read()` →
    {bucket's lower bound of rows: ms} (orchestrator/forward_costs.py)."""
    REGISTRY.register(_TableGauge(
        "specdec_target_forward_ms", "The target forward's compute time (decayed mean, ms) by its rows, as the "
        "adaptive γ policy has measured it; rows is the lower bound of the bucket", "rows", read))


def export_governor(read: Callable[[], dict]) -> None:
    """specdec_load_governor{key}: per sampling kind and load (generations in flight, a power
    of two), whether adaptive sessions speculate and each mode's measured per-session tokens/s
    (orchestrator/governor.py); `read()` → {"kind,load,measure": value}."""
    REGISTRY.register(_TableGauge(
        "specdec_load_governor", "Under load, per sampling kind and load: speculating (1/0) and the measured "
        "per-session tokens/s with speculation on and off", "key", read))


def serve_metrics(port: int) -> None:
    """Start the /metrics HTTP endpoint (port 0 = off). A port taken (by another server's
    metrics, or a node exporter on 9100) is an OSError naming it."""
    if port:
        try:
            start_http_server(port)
        except OSError as exc:
            raise OSError(f"cannot serve /metrics on port {port}: {exc.strerror or exc}") from None
