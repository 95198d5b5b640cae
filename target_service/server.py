"""The Target gRPC service: a thin shell over TargetEngine."""
from __future__ import annotations

import argparse
import asyncio

from specdec import event_loop, sampling
from specdec.config import (add_common_args, add_replica_args, check_start_settings, env, parse_args,
                            refusing_to_start)
from specdec.draft_rows import Law
from specdec.errors import InvalidRequest, value_or_raise
from specdec.frame_server import MuxMethod
from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from specdec.models import BUNDLED_TARGET
from specdec.replica import ReplicaHost, build_runner
from specdec.sampling_params import shapes
from specdec.wire import WireFormatError, decode, decode_half
from specdec.wire_pb import from_pb, params_from_pb, ref_from_pb
from target_service.engine import TargetEngine, Verdict, VerifyJob

SERVICE = replica_pb2.DESCRIPTOR.services_by_name["Target"].full_name


def distributions_from_pb(pb: replica_pb2.DraftDistributions, gamma: int, vocab: int, greedy: bool = False,
                          half: bool = False) -> Law | None:
    """The draft's distributions, or None where none are needed: no draft, or a greedy
    request that sent none (the greedy rule compares tokens only). `half`: kept fp16 beside
    their sums (specdec.wire.decode_half, for verdicts on a GPU), else decoded to float64."""
    if gamma == 0 or (greedy and pb.vocab_size == 0):
        return None
    if pb.vocab_size != vocab:
        raise InvalidRequest(f"draft distributions are over {pb.vocab_size} tokens but the target has {vocab}")
    enc = from_pb(pb)
    try:
        return decode_half(enc, gamma) if half else decode(enc, gamma)
    except WireFormatError as exc:
        raise InvalidRequest(str(exc)) from exc


# distributions of this many values (γ × vocabulary) on are decoded on a worker thread: a
# draft of γ = 4 over a 128k vocabulary takes about half a millisecond (specdec.wire.decode
# writes its [γ, V] float64 rows, dense or sparse), which would hold the event loop, and
# with it every other call's reading and answering, per message
INLINE_DECODE_VALUES = 1 << 17


async def distributions(pb: replica_pb2.DraftDistributions, gamma: int, vocab: int, greedy: bool = False,
                        half: bool = False) -> Law | None:
    """`distributions_from_pb`, on a worker thread where the rows are large (the native
    decode runs without the GIL, so several decode at once beside the event loop)."""
    if gamma * max(pb.vocab_size, 0) < INLINE_DECODE_VALUES:
        return distributions_from_pb(pb, gamma, vocab, greedy, half)
    return await asyncio.to_thread(distributions_from_pb, pb, gamma, vocab, greedy, half)


def verdict_to_pb(verdict: Verdict) -> replica_pb2.VerifyResponse:
    """A verdict as it travels (benchmarks/wire_meter.py counts the same message)."""
    return replica_pb2.VerifyResponse(
        accepted=verdict.accepted, next_token=verdict.next_token, cache_length=verdict.cache_length,
        compute_ms=verdict.compute_ms, batch_size=verdict.batch_size, resynced=verdict.resynced,
        batch_tokens=verdict.batch_tokens, keep_chances=verdict.keep_chances or (),
        logprobs=verdict.logprobs or (), top_token_ids=verdict.top_ids or (), top_logprobs=verdict.top_logprobs or (),
        fed_logprobs=verdict.fed_logprobs or (), fed_top_token_ids=verdict.fed_top_ids or (),
        fed_top_logprobs=verdict.fed_top_logprobs or ())


class TargetServicer(replica_pb2_grpc.TargetServicer):
    def __init__(self, host: ReplicaHost) -> None:
        self.host = host

    async def verify(self, request: replica_pb2.VerifyRequest) -> replica_pb2.VerifyResponse:
        """One verification, for the unary call and for each message of a stream."""
        gamma = len(request.draft_tokens)
        params = params_from_pb(request.sampling)
        engine = self.host.engine
        q = await distributions(request.distributions, gamma, engine.runner.vocab_size, params.greedy, engine.half_rows)
        job = VerifyJob(ref_from_pb(request.cache), list(request.draft_tokens), q, params, request.logprobs,
                        request.top_logprobs, request.fed_logprobs, request.processed_logprobs)
        reply = verdict_to_pb(value_or_raise(await self.host.batcher.submit(job)))
        # say what was applied (a replica from before these fields leaves them unset)
        reply.min_p, reply.processed_logprobs = params.min_p, request.processed_logprobs
        reply.shaped = shapes(params)
        return reply

    async def Verify(self, request, context):
        return await self.host.answer(self.verify, request, context)

    async def VerifyStream(self, request_iterator, context):
        async for response in self.host.answer_stream(self.verify, request_iterator, context):
            yield response

    async def VerifyMux(self, request_iterator, context):
        await self.host.answer_mux(self.verify, request_iterator, context,
                                   replica_pb2.VerifyAnswer, replica_pb2.VerifyAnswers)

    async def Release(self, request, context):
        return replica_pb2.ReleaseResponse(released=await self.host.release(request.session_id))

    async def Load(self, request, context):
        return self.host.load_report()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m target_service",
                                 description="Target pool replica: verifies whole drafts of many sessions in one forward pass.")
    add_common_args(ap, default_port=50071)
    add_replica_args(ap, "target", str(BUNDLED_TARGET))
    ap.add_argument("--verification", choices=sampling.RULES, default=env("VERIFICATION", "block"),
                    help="how sampled drafts are verified: block (jointly, Sun et al. 2025: at least as many "
                         "tokens a round in expectation) or token (each draft token on its own, Leviathan et al. "
                         "2023); both give exactly the target's law, greedy is the same under both; every target "
                         "replica of a deployment should use the same, so that seeded requests reproduce "
                         "[SPECDEC_VERIFICATION]")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    with refusing_to_start("target_service"):
        loop = event_loop.resolve(args.event_loop)
        check_start_settings(args)
    runner = build_runner(args, "target_service")
    engine = TargetEngine(runner, args.max_sessions, args.max_cache_mb * 2**20, args.verification)
    engine.sessions.reuse_prefixes = args.prefix_reuse == "on"

    async def run() -> None:
        host = ReplicaHost(args, engine, engine.verify, SERVICE, prog="target_service")
        servicer = TargetServicer(host)
        await host.serve(lambda server: replica_pb2_grpc.add_TargetServicer_to_server(servicer, server),
                         {"VerifyMux": MuxMethod(servicer.verify, replica_pb2.VerifyCalls, replica_pb2.VerifyAnswer,
                                           replica_pb2.VerifyAnswers)})

    event_loop.run(run(), loop)
