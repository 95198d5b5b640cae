"""The public Orchestrator gRPC service: a thin shell over Generator."""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import math
import time
import uuid

import grpc
from google.protobuf.message import DecodeError

from orchestrator import access_log, ngram
from orchestrator.gamma_policy import CostModel
from orchestrator.generation import (DRAFT_WAIT_S, FIRST_ROUNDS, OVERLAP_FORKS, PREFILL_CHUNK, OVERLAP_MIN_USE,
                                    RETRY_WINDOW_S, STOP_BELOW_GREEDY, STOP_BELOW_SAMPLED, Generator, Outcome, deadline_passed)
from orchestrator.governor import MARGIN as GOVERNOR_MARGIN, LoadGovernor
from orchestrator.pools import PoolClients
from orchestrator.reaper import INTERVAL_S as REAP_INTERVAL_S, Reaper
from orchestrator.round_stream import CALL_MODES
from orchestrator.validation import SESSION_ID, validate
from specdec import event_loop, metrics
from specdec.config import add_common_args, env, parse_args, read_secret, redis_client, refusing_to_start, setup_logging
from specdec.errors import InvalidRequest, Overloaded, SpecDecError, Unavailable
from specdec.gc_tuning import freeze_startup_heap
from specdec.grpc_server import ServerShell, abort, end_leftover_tasks, server_credentials, status_of, watch_stop
from specdec.logprob_records import TokenLogprob
from specdec.model_files import BUNDLED_TARGET, end_token_ids, load_tokenizer
from specdec.registry import Registry
from specdec.session_store import LEASE_SECONDS, SessionStore
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Orchestrator"].full_name
FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP, "eos": pb.FINISH_REASON_EOS,
          "context": pb.FINISH_REASON_CONTEXT}


def stats_pb(out: Outcome) -> pb.GenerationStats:
    s = out.stats
    return pb.GenerationStats(
        rounds=s.rounds, drafted_tokens=s.drafted, accepted_tokens=s.accepted, target_forward_passes=s.target_passes,
        acceptance_rate=s.accepted / s.drafted if s.drafted else 0.0,
        tokens_per_target_pass=(len(out.tokens) - s.resumed) / s.target_passes if s.target_passes else 0.0,
        prompt_tokens=out.prompt_tokens, generated_tokens=len(out.tokens), seed=out.seed,
        draft_replica=out.draft_replica, target_replica=out.target_replica,
        mean_gamma=s.gamma_sum / s.rounds if s.rounds else 0.0, replica_failovers=s.failovers,
        wire_bytes=s.wire_bytes, overlap_hits=s.overlap_hits, rounds_rejected=s.rejections, resumed_tokens=s.resumed,
        lookup_drafted_tokens=s.looked_up,
        times=pb.StageTimes(draft_ms=s.draft_ms, verify_ms=s.verify_ms, redis_ms=s.redis_ms,
                            network_ms=s.network_ms, total_ms=out.total_ms, first_token_ms=s.first_token_ms))


def logprobs_pb(tokens: list[int], scores: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    """The tokens' log-probabilities as they travel, one per token (none where not asked)."""
    if not scores:
        return []
    return [pb.TokenLogprob(token_id=token, logprob=score.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in score.top])
            for token, score in zip(tokens, scores)]


def prompt_logprobs_pb(out: Outcome) -> list[pb.TokenLogprob]:
    if not out.prompt_logprobs:
        return []
    tokens, scores = zip(*out.prompt_logprobs)
    return logprobs_pb(list(tokens), list(scores))


def _gone(deadline: float | None) -> tuple[grpc.StatusCode, str]:
    """Why gRPC cancelled a call in flight, for the access log: its deadline (read as the
    loop reads an internal call's, whose timers fire up to a millisecond early), or its client."""
    if deadline_passed(deadline, time.monotonic()):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"
    return grpc.StatusCode.CANCELLED, "the client went away"


async def _settle(task: asyncio.Task) -> None:
    """Stops a stream's generation loop if its call ended first (the caches are released as
    it unwinds), and takes its outcome so that asyncio reports no unretrieved error."""
    if not task.done():
        task.cancel()
    try:
        await task
    except (asyncio.CancelledError, SpecDecError):
        pass


def count_call(method: str, code: grpc.StatusCode, started: float, request, out: Outcome | None,
               peer: str | None, error: str = "") -> None:
    """A call that ended with `code`: the requests counter and its access line, one beside
    the other wherever a call is answered."""
    metrics.REQUESTS.labels(method, code.name).inc()
    access_log.record(method, code, started, request, out, peer, error)


def observe_latency(method: str, out: Outcome) -> None:
    """A successful request's latencies, as a platform team sets its objectives on them:
    the whole call, the first chunk of a stream, and the time per token after the first
    (a round yields several tokens, so the first chunk may hold more than one)."""
    metrics.REQUEST_SECONDS.labels(method).observe(out.total_ms / 1000)
    first = out.stats.first_token_ms
    if first and method == "GenerateStream":
        metrics.FIRST_TOKEN_SECONDS.observe(first / 1000)
    if first and len(out.tokens) >= 2:
        metrics.TOKEN_SECONDS.labels(method).observe((out.total_ms - first) / (len(out.tokens) - 1) / 1000)


class _BadMessage:
    """Stands in for a request that did not parse (e.g. invalid UTF-8 in a string)."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:
            return _BadMessage(str(exc) or type(exc).__name__)
    return deserialize


# prompts longer than this are tokenized off the event loop; shorter ones cost under a
# millisecond inline, less than a hand-off to a thread and back
INLINE_PROMPT_CHARS = 1024


class OrchestratorServicer(pb_grpc.OrchestratorServicer):
    def __init__(self, generator: Generator, vocab_size: int, max_new_tokens: int, max_concurrent: int) -> None:
        self.gen = generator
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.max_concurrent = max_concurrent
        self.active = 0
        self.draining = False  # set at SIGTERM: new generations are refused, those in flight finish

    async def drained(self, timeout: float) -> bool:
        """Wait up to `timeout` for the generations in flight to end; → whether they all did."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.active

    async def _request(self, request):
        """The checked request. A long prompt (or conversation) is tokenized in a worker
        thread (the tokenizer releases the GIL): on the event loop, 200,000 characters would
        hold every other generation's rounds for about 0.1 s here (40 ms for 83,000, ad hoc,
        2026-12-05)."""
        if isinstance(request, _BadMessage):
            raise InvalidRequest(f"the request is not a valid GenerateRequest (check that strings are UTF-8): "
                                 f"{request.error}")
        args = (request, self.gen.tokenizer, self.vocab_size, self.gen.max_len, self.max_new_tokens)
        if len(request.prompt) + sum(len(m.content) for m in request.messages) > INLINE_PROMPT_CHARS:
            return await asyncio.to_thread(validate, *args)
        return validate(*args)

    def _admit(self) -> None:
        if self.draining:
            raise Unavailable("this orchestrator is shutting down and takes no new generations; retry the "
                              "call (a load balancer sends it to another orchestrator)")
        if self.active >= self.max_concurrent:
            raise Overloaded(f"the server is at its limit of {self.max_concurrent} concurrent generations; "
                             "retry with backoff")

    @staticmethod
    def _deadline(context) -> float | None:
        left = context.time_remaining()
        return None if left is None else time.monotonic() + left

    async def Generate(self, request, context):
        # the peer and the deadline now: asked once the call has ended (its deadline passed,
        # its client gone), gRPC may answer None, or take the process down with it
        started, peer, deadline = time.perf_counter(), context.peer(), self._deadline(context)
        text, scores = [], []

        async def emit(chunk: str, new: list[int], logprobs: list[TokenLogprob] | None) -> None:
            text.append(chunk)
            if logprobs:
                scores.extend(logprobs)

        try:
            req = await self._request(request)
            self._admit()
            self.active += 1
            try:
                out = await self.gen.run(req, emit, deadline)
            finally:
                self.active -= 1
        except SpecDecError as exc:
            count_call("Generate", status_of(exc), started, request, None, peer, str(exc))
            await abort(context, exc)
        except asyncio.CancelledError:
            code, why = _gone(deadline)
            access_log.record("Generate", code, started, request, None, peer, why)
            raise
        count_call("Generate", grpc.StatusCode.OK, started, request, out, peer)
        observe_latency("Generate", out)
        return pb.GenerateResponse(text="".join(text), token_ids=out.tokens, session_id=out.session_id,
                                   finish_reason=FINISH[out.finish_reason], stats=stats_pb(out),
                                   logprobs=logprobs_pb(out.tokens, scores), prompt_logprobs=prompt_logprobs_pb(out))

    async def GenerateStream(self, request, context):
        started, peer, deadline = time.perf_counter(), context.peer(), self._deadline(context)  # as Generate's
        queue: asyncio.Queue = asyncio.Queue()

        async def emit(chunk: str, new: list[int], logprobs: list[TokenLogprob] | None) -> None:
            await queue.put(pb.GenerateStreamResponse(text=chunk, token_ids=new, logprobs=logprobs_pb(new, logprobs)))

        task = None
        try:
            req = await self._request(request)
            self._admit()
            self.active += 1
            task = asyncio.create_task(self.gen.run(req, emit, deadline))
            task.add_done_callback(lambda _: queue.put_nowait(None))
            while True:
                item = await queue.get()
                if item is None:
                    break
                yield item
            out = task.result()
        except SpecDecError as exc:
            count_call("GenerateStream", status_of(exc), started, request, None, peer, str(exc))
            await abort(context, exc)
        except (asyncio.CancelledError, GeneratorExit):
            # gRPC ended the call (its deadline, its client gone), perhaps just as the loop
            # failed on the same deadline: a check of the loop's task missed that call's line
            # (tests/e2e/test_access_log.py, 2026-12-07)
            code, why = _gone(deadline)
            access_log.record("GenerateStream", code, started, request, None, peer, why)
            raise
        finally:
            if task is not None:
                self.active -= 1
                await _settle(task)
        count_call("GenerateStream", grpc.StatusCode.OK, started, request, out, peer)
        observe_latency("GenerateStream", out)
        yield pb.GenerateStreamResponse(session_id=out.session_id, finish_reason=FINISH[out.finish_reason],
                                        stats=stats_pb(out), prompt_logprobs=prompt_logprobs_pb(out))

    async def EndSession(self, request, context):
        try:
            if isinstance(request, _BadMessage):
                raise InvalidRequest(f"the request is not a valid EndSessionRequest: {request.error}")
            if not request.session_id:
                raise InvalidRequest("session_id is required")
            if not SESSION_ID.match(request.session_id):
                raise InvalidRequest("session_id must be 1..128 characters of letters, digits, '_', '-', '.', ':'")
            # held like a generation's: a session still generating is refused (ABORTED), not
            # deleted under that call
            handle = await self.gen.store.acquire(request.session_id, uuid.uuid4().hex)
            await self.gen.release(handle)
        except SpecDecError as exc:
            await abort(context, exc)
        return pb.EndSessionResponse(released=True)


def add_servicer(servicer: OrchestratorServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_OrchestratorServicer_to_server, but a request that does not
    parse reaches the servicer (which answers INVALID_ARGUMENT) instead of failing as UNKNOWN."""
    parse = _lenient(pb.GenerateRequest.FromString)
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=parse,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=parse,
            response_serializer=pb.GenerateStreamResponse.SerializeToString),
        "EndSession": grpc.unary_unary_rpc_method_handler(
            servicer.EndSession, request_deserializer=_lenient(pb.EndSessionRequest.FromString),
            response_serializer=pb.EndSessionResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class TokenAuth(grpc.aio.ServerInterceptor):
    """Bearer-token authentication on the public API; health and reflection stay open
    for probes and tools."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if not details.method.startswith(f"/{SERVICE}/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return await continuation(details)
        handler = await continuation(details)

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token "
                                "(send metadata 'authorization: Bearer <token>')")

        async def deny_stream(request, context):
            await deny_unary(request, context)
            yield  # pragma: no cover

        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, request_deserializer=handler.request_deserializer)
        return grpc.unary_unary_rpc_method_handler(deny_unary, request_deserializer=handler.request_deserializer if handler else None)


# after a drain, how long the generations it cut short may take to release their sessions
# (a replica's Release is given 2 s): inside the stop watch's slack (specdec/grpc_server.py)
WIND_DOWN_S = 3.0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m orchestrator",
                                 description="Public gRPC API of the speculative-decoding server.")
    add_common_args(ap, default_port=50051)
    ap.add_argument("--tokenizer", default=env("TOKENIZER", str(BUNDLED_TARGET)),
                    help="tokenizer (and model config) directory or Hub id of the target model [SPECDEC_TOKENIZER]")
    ap.add_argument("--max-context", type=int, default=int(env("MAX_CONTEXT", 0)),
                    help="model context in tokens, 0 = read max_position_embeddings from --tokenizer [SPECDEC_MAX_CONTEXT]")
    ap.add_argument("--max-new-tokens", type=int, default=int(env("MAX_NEW_TOKENS", 1024)),
                    help="largest max_new_tokens a request may ask [SPECDEC_MAX_NEW_TOKENS]")
    ap.add_argument("--max-concurrent", type=int, default=int(env("MAX_CONCURRENT", 256)),
                    help="concurrent generations before RESOURCE_EXHAUSTED [SPECDEC_MAX_CONCURRENT]")
    ap.add_argument("--session-ttl", type=int, default=int(env("SESSION_TTL", 600)),
                    help="seconds a session handle lives in Redis after its last use [SPECDEC_SESSION_TTL]")
    ap.add_argument("--session-lease", type=float, default=float(env("SESSION_LEASE", LEASE_SECONDS)),
                    help=f"seconds a call holds its session in Redis without completing a round (default "
                         f"{LEASE_SECONDS:g}); every round renews it. A session whose orchestrator stopped "
                         f"mid-call is free again after this long; a call that went longer between rounds "
                         f"(a replica hanging for --call-timeout) keeps its session unless another call took "
                         f"it meanwhile [SPECDEC_SESSION_LEASE]")
    ap.add_argument("--retry-window", type=int, default=int(env("RETRY_WINDOW", RETRY_WINDOW_S)),
                    help=f"seconds a whole answer to a request with a request_id, on a session not kept, stays "
                         f"in Redis (default {RETRY_WINDOW_S}): a retry with the same id within it gets the same "
                         f"answer; a cut answer keeps its caches this long for its retry to continue, then "
                         f"its handle only, for --session-ttl [SPECDEC_RETRY_WINDOW]")
    ap.add_argument("--reap-interval", type=float, default=float(env("REAP_INTERVAL", REAP_INTERVAL_S)),
                    help=f"seconds between checks for sessions an orchestrator that died left running (default "
                         f"{REAP_INTERVAL_S:g}; 0 = none): once the dead call's --session-lease has run out, their "
                         f"caches and handles are released, not left for --session-ttl [SPECDEC_REAP_INTERVAL]")
    ap.add_argument("--draft-pool", default=env("DRAFT_POOL", "draft"),
                    help="the draft replicas' pool in the Redis registry: their --pool (default draft) "
                         "[SPECDEC_DRAFT_POOL]")
    ap.add_argument("--target-pool", default=env("TARGET_POOL", "target"),
                    help="the target replicas' pool in the Redis registry: their --pool (default target) "
                         "[SPECDEC_TARGET_POOL]")
    ap.add_argument("--api-token-file", default=env("API_TOKEN_FILE"),
                    help="file with the bearer token clients must send; unset = no auth [SPECDEC_API_TOKEN_FILE]")
    ap.add_argument("--client-cert-file", default=env("CLIENT_CERT_FILE"),
                    help="client certificate for mutual TLS to the pools [SPECDEC_CLIENT_CERT_FILE]")
    ap.add_argument("--client-key-file", default=env("CLIENT_KEY_FILE"),
                    help="key (PEM) of --client-cert-file [SPECDEC_CLIENT_KEY_FILE]")
    ap.add_argument("--pool-ca-file", default=env("POOL_CA_FILE"),
                    help="CA that signed the pools' certificates; set = TLS to the pools [SPECDEC_POOL_CA_FILE]")
    ap.add_argument("--overlap-min-hit", type=float, default=float(env("OVERLAP_MIN_HIT", 0.25)),
                    help="pre-draft round k+1 while round k is verified when the estimated chance of "
                         "using it (α^γ times the session's rate of right bonus guesses) is at least this; "
                         "0 = always, above 1 = never [SPECDEC_OVERLAP_MIN_HIT]")
    ap.add_argument("--overlap-min-use", type=float, default=float(env("OVERLAP_MIN_USE", OVERLAP_MIN_USE)),
                    help="under load (sessions sharing the target's batches), pre-draft only while at least this "
                         "share of the sampling kind's pre-drafts were used, in [0, 1]; 0 = whatever their use "
                         "[SPECDEC_OVERLAP_MIN_USE]")
    ap.add_argument("--overlap-forks", type=int, default=int(env("OVERLAP_FORKS", OVERLAP_FORKS)),
                    help="greedy sessions while the target serves them alone: beside the main pre-draft, "
                         "pre-draft up to this many branches a rejected round may take (each from the draft's "
                         "runner-up token, the likeliest correction); 0 (the default) = none: on a CPU the "
                         "draft's batch of forks tends to outlast the verification [SPECDEC_OVERLAP_FORKS]")
    ap.add_argument("--stop-below-greedy", type=float, default=float(env("STOP_BELOW_GREEDY", STOP_BELOW_GREEDY)),
                    help="adaptive greedy sessions: the draft ends a proposal after a token whose top probability "
                         "is below this, in [0, 1); 0 = off (the default: on the bundled pair it cost throughput "
                         "through the services, see orchestrator/generation.py) [SPECDEC_STOP_BELOW_GREEDY]")
    ap.add_argument("--stop-below-sampled", type=float, default=float(env("STOP_BELOW_SAMPLED", STOP_BELOW_SAMPLED)),
                    help="the same for sampled sessions (temperature > 0); 0 = off, the default: on the bundled "
                         "pair no threshold paid there even in process (benchmarks.stop_rule_probe) "
                         "[SPECDEC_STOP_BELOW_SAMPLED]")
    ap.add_argument("--access-log", choices=("on", "off"), default=env("ACCESS_LOG", "on"),
                    help="one log line per finished Generate or GenerateStream call (method, status, ms, peer, "
                         "session, tokens, finish reason, replicas, rounds, mean γ, acceptance; fields of the "
                         "JSON object under --log-format json), whatever --log-level says "
                         "(orchestrator/access_log.py) [SPECDEC_ACCESS_LOG]")
    ap.add_argument("--load-governor", choices=("on", "off"), default=env("LOAD_GOVERNOR", "on"),
                    help="while several generations run: turn adaptive speculation off for a sampling kind "
                         "and load where, measured window by window against target-only decoding, it is "
                         "slower (orchestrator/governor.py); off = the γ policy alone [SPECDEC_LOAD_GOVERNOR]")
    ap.add_argument("--load-governor-margin", type=float, default=float(env("LOAD_GOVERNOR_MARGIN", GOVERNOR_MARGIN)),
                    help=f"the governor speculates only where that beats target-only decoding by more than this "
                         f"share (default {GOVERNOR_MARGIN}): within it the two trade places on noise and each switch "
                         f"costs the draft a catch-up [SPECDEC_LOAD_GOVERNOR_MARGIN]")
    ap.add_argument("--call-timeout", type=float, default=float(env("CALL_TIMEOUT", 30.0)),
                    help="seconds an internal call may take: one not answered by then counts as its replica "
                         "failing, which is avoided for a while, and the session moves to another replica of "
                         "the pool (its cache rebuilt there) or, for a draft, goes on target-only. A replica "
                         "that hangs without failing (a partition, a stuck device) costs its sessions this "
                         "long; the target's calls under load must fit in it [SPECDEC_CALL_TIMEOUT]")
    ap.add_argument("--prefill-chunk", type=int, default=int(env("PREFILL_CHUNK", PREFILL_CHUNK)),
                    help=f"a replica is fed a long prompt (or a cache rebuilt after a failover) this many tokens "
                         f"a call (default {PREFILL_CHUNK}), so that each batched forward holds the other sessions "
                         f"in it for one chunk's share only; 0 = the whole feed in one call [SPECDEC_PREFILL_CHUNK]")
    ap.add_argument("--draft-wait-ms", type=float, default=float(env("DRAFT_WAIT_MS", DRAFT_WAIT_S * 1000)),
                    help="a draft call not answered within this is left to finish on its own and the round "
                         "verifies target-only; the session calls its draft again once that call has ended. "
                         "A stalled draft replica then costs a generation this wait, not the stall; 0 = wait "
                         "for the call's whole timeout. Seeded sampled requests always wait (they must "
                         "reproduce) [SPECDEC_DRAFT_WAIT_MS]")
    ap.add_argument("--first-round", choices=FIRST_ROUNDS, default=env("FIRST_ROUND", "target"),
                    help="how a call's first round is drafted: target (default) drafts it by prompt lookup only "
                         "(greedy) or not at all, so the first token streams after the target's prefill "
                         "alone, as target-only decoding's does, while the draft prefills the prompt beside it "
                         "and drafts the second round on its guess of that token; speculate drafts it as any "
                         "round, so its first chunk carries several tokens but comes after the draft's "
                         "prefill, its steps and the target's verification (adaptive γ only: a request fixing "
                         "γ drafts as it asks) [SPECDEC_FIRST_ROUND]")
    ap.add_argument("--prefix-affinity", choices=("on", "off"), default=env("PREFIX_AFFINITY", "on"),
                    help="on: a new session whose prompt begins alike with others goes where that beginning "
                         "is held (the replicas' prefix reuse), among the replicas nearly as little loaded as "
                         "the least; off: by load alone, every replica sharing every kind of prompt alike "
                         "(default on) [SPECDEC_PREFIX_AFFINITY]")
    ap.add_argument("--prompt-lookup", choices=(*ngram.MODES, "on"), default=env("PROMPT_LOOKUP", "greedy"),
                    help="rounds that no draft replica drafts (an empty or failed draft pool, a late draft, "
                         "drafting off under load or priced out) draft by prompt lookup instead of decoding "
                         "target-only, and adaptive rounds look up instead of drafting where that is worth "
                         "more: the tokens that followed the latest earlier occurrence of the context's last "
                         "2-3 tokens, verified as any draft (a point mass each when sampled), so the answer "
                         "or its law is the same. greedy (default; on is the same): greedy sessions only; "
                         "all: unseeded sampled sessions too (pays where sampled text repeats, as in code "
                         "edits; costs a little where it does not); off [SPECDEC_PROMPT_LOOKUP]")
    ap.add_argument("--internal-calls", choices=CALL_MODES, default=env("INTERNAL_CALLS", "frames"),
                    help="how generations call the pools: frames (default: one stream per replica shared by "
                         "every generation, the calls of one moment in one message, over the replica's frame link, "
                         "a plain TCP or TLS connection, where it has one, else as mux), mux (the same over "
                         "gRPC), stream (one stream per replica per generation: saves a call "
                         "set-up per round) or unary (a call per round) [SPECDEC_INTERNAL_CALLS]")
    ap.add_argument("--pool-tls-server-name", default=env("POOL_TLS_SERVER_NAME"),
                    help="name in the pools' certificate, when it does not match the dialled address "
                         "(e.g. specdec-draft.specdec.svc) [SPECDEC_POOL_TLS_SERVER_NAME]")
    return ap


def max_context(args) -> int:
    if args.max_context:
        return args.max_context
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(args.tokenizer).max_position_embeddings)


async def serve(args: argparse.Namespace) -> None:
    setup_logging(args.log_level, args.log_format)
    access_log.configure(args.access_log == "on")
    with refusing_to_start("orchestrator"):
        tokenizer = load_tokenizer(args.tokenizer)
        end_ids = end_token_ids(args.tokenizer, tokenizer)
        context = max_context(args)
        token = read_secret(args.api_token_file)
        creds = server_credentials(args.tls_cert_file, args.tls_key_file, None)
        redis = redis_client(args.redis_url, args.redis_password_file)
        pools = PoolClients(Registry(redis), args.draft_pool, args.target_pool, args.pool_ca_file,
                            args.client_cert_file, args.client_key_file, tls_server_name=args.pool_tls_server_name,
                            frames=args.internal_calls == "frames", prefix_affinity=args.prefix_affinity == "on")
    orchestrator_id = Reaper.new_id()
    store = SessionStore(redis, args.session_ttl, lease_seconds=args.session_lease, orchestrator_id=orchestrator_id)
    generator = _generator(args, pools, store, tokenizer, context, end_ids)
    log.info("answers end at token ids %s (the tokenizer's EOS and the generation config's)", sorted(end_ids))
    shell = ServerShell([SERVICE], interceptors=[TokenAuth(token)] if token else [])
    servicer = OrchestratorServicer(generator, len(tokenizer), args.max_new_tokens, args.max_concurrent)
    add_servicer(servicer, shell.server)
    with refusing_to_start("orchestrator"):  # a port taken
        port = shell.listen(args.host, args.port, creds)
        metrics.serve_metrics(args.metrics_port)
    log.info("froze %d start-up objects out of garbage collection", freeze_startup_heap())
    reaper = Reaper(generator, redis, orchestrator_id, args.reap_interval)
    await reaper.start()
    await shell.server.start()
    await shell.set_serving(True)
    shell.install_signal_handlers()
    log.info("orchestrator %s serving on %s:%d (tls=%s, auth=%s, event loop %s)", orchestrator_id, args.host, port,
             bool(creds), bool(token), event_loop.running())
    await shell.stopping.wait()
    end_watch = watch_stop(args.drain_seconds)
    await _drain(shell, servicer, generator, args.drain_seconds)
    await reaper.stop()
    await pools.close()
    await redis.aclose()
    await end_leftover_tasks()
    end_watch()
    log.info("stopped")


def _generator(args: argparse.Namespace, pools: PoolClients, store: SessionStore, tokenizer, context: int,
               end_ids: frozenset[int]) -> Generator:
    """The loop, with the cost model and the load governor it learns as it runs (their tables
    exported as metrics)."""
    costs = CostModel()
    metrics.export_target_forward_ms(costs.forward.table)
    governor = LoadGovernor(enabled=args.load_governor == "on", margin=args.load_governor_margin)
    metrics.export_governor(governor.table)
    return Generator(pools, store, tokenizer, context, costs,
                     overlap=args.overlap_min_hit <= 1, overlap_min_hit=args.overlap_min_hit,
                     overlap_min_use=args.overlap_min_use, overlap_forks=args.overlap_forks,
                     calls=args.internal_calls,
                     stop_below=(args.stop_below_greedy, args.stop_below_sampled), governor=governor,
                     call_timeout=args.call_timeout, draft_wait=args.draft_wait_ms / 1000 or None,
                     prefill_chunk=args.prefill_chunk, retry_window=args.retry_window,
                     lookup=args.prompt_lookup, end_ids=end_ids, first_round=args.first_round)


async def _drain(shell: ServerShell, servicer: OrchestratorServicer, generator: Generator, seconds: float) -> None:
    """The servicer refuses new generations with UNAVAILABLE while those in flight finish, and
    only then does the server stop: calls that reached a server already stopping were seen
    to fail CANCELLED, which clients and gRPC's retry policies do not retry. Generations the
    drain cut short then get WIND_DOWN_S to release their sessions."""
    log.info("draining: refusing new calls, finishing streams in flight (up to %.0fs)", seconds)
    servicer.draining = True
    await shell.set_serving(False)
    started = time.monotonic()
    await servicer.drained(seconds)
    await shell.drain_and_stop(max(0.0, seconds - (time.monotonic() - started)))
    releasing = await generator.wind_down(WIND_DOWN_S)
    if releasing:
        log.warning("%d generation(s) cut short by the drain still releasing their sessions after %.0fs; "
                    "their handles expire by TTL", releasing, WIND_DOWN_S)


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = parse_args(ap, argv)
    for flag in ("stop_below_greedy", "stop_below_sampled", "load_governor_margin"):
        if not 0 <= getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must lie in [0, 1), got {getattr(args, flag)}")
    if not 0 <= args.overlap_forks <= 16:
        ap.error(f"--overlap-forks must lie in 0..16, got {args.overlap_forks}")
    if args.prefill_chunk < 0:
        ap.error(f"--prefill-chunk must be 0 (off) or a number of tokens, got {args.prefill_chunk}")
    if not 0 < args.call_timeout < math.inf:
        ap.error(f"--call-timeout must be a finite number of seconds above 0, got {args.call_timeout}")
    if not 0 <= args.draft_wait_ms < math.inf:
        ap.error(f"--draft-wait-ms must be a finite number of milliseconds, 0 or more, got {args.draft_wait_ms}")
    if not 0 < args.session_lease < math.inf:
        ap.error(f"--session-lease must be a finite number of seconds above 0, got {args.session_lease}")
    if not 0 <= args.reap_interval < math.inf:
        ap.error(f"--reap-interval must be a finite number of seconds, 0 (off) or more, got {args.reap_interval}")
    if args.retry_window < 1:
        ap.error(f"--retry-window must be at least 1 second, got {args.retry_window}")
    if args.session_ttl < 1:
        ap.error(f"--session-ttl must be at least 1 second, got {args.session_ttl}")
    if not 0 <= args.overlap_min_use <= 1:
        ap.error(f"--overlap-min-use must lie in [0, 1], got {args.overlap_min_use}")
    with refusing_to_start("orchestrator"):
        loop = event_loop.resolve(args.event_loop)
    event_loop.run(serve(args), loop)
