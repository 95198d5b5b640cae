"""The Draft gRPC service: a thin shell over DraftEngine."""
from __future__ import annotations

import argparse

import torch

from draft_service.engine import DraftEngine, ProposeJob
from specdec import event_loop
from specdec.config import (add_common_args, add_replica_args, check_start_settings, env, parse_args,
                            refusing_to_start)
from specdec.errors import InvalidRequest, value_or_raise
from specdec.frame_server import MuxMethod
from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from specdec.models import BUNDLED_DRAFT
from specdec.quantize import CHOICES as QUANTIZE_CHOICES
from specdec.replica import ReplicaHost, build_runner
from specdec.wire import encode
from specdec.wire_pb import params_from_pb, ref_from_pb, to_pb

SERVICE = replica_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


def distributions_pb(q16: torch.Tensor | None) -> replica_pb2.DraftDistributions | None:
    """A proposal's quantised distributions in their wire form; None (the field unset) for
    a greedy proposal, which has none."""
    return None if q16 is None else to_pb(encode(q16))


class DraftServicer(replica_pb2_grpc.DraftServicer):
    def __init__(self, host: ReplicaHost) -> None:
        self.host = host

    async def propose(self, request: replica_pb2.ProposeRequest) -> replica_pb2.ProposeResponse:
        """One proposal, for the unary call and for each message of a stream."""
        if not 0 <= request.stop_below < 1:  # NaN fails too
            raise InvalidRequest(f"stop_below must lie in [0, 1), got {request.stop_below}")
        job = ProposeJob(ref_from_pb(request.cache), request.num_tokens, params_from_pb(request.sampling),
                         request.guess_bonus, request.stop_below, request.runner_ups, request.fork)
        result = value_or_raise(await self.host.batcher.submit(job))
        return replica_pb2.ProposeResponse(
            draft_tokens=result.tokens, cache_length=result.cache_length, compute_ms=result.compute_ms,
            batch_size=result.batch_size, distributions=distributions_pb(result.q),
            runner_ups=result.runner_ups or ())

    async def Propose(self, request, context):
        return await self.host.answer(self.propose, request, context)

    async def ProposeStream(self, request_iterator, context):
        async for response in self.host.answer_stream(self.propose, request_iterator, context):
            yield response

    async def ProposeMux(self, request_iterator, context):
        await self.host.answer_mux(self.propose, request_iterator, context,
                                   replica_pb2.ProposeAnswer, replica_pb2.ProposeAnswers)

    async def Release(self, request, context):
        return replica_pb2.ReleaseResponse(released=await self.host.release(request.session_id))

    async def Load(self, request, context):
        return self.host.load_report()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m draft_service",
                                 description="Draft pool replica: proposes γ tokens per session with their exact distributions.")
    add_common_args(ap, default_port=50061)
    add_replica_args(ap, "draft", str(BUNDLED_DRAFT))
    ap.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=env("QUANTIZE", "auto"),
                    help="the draft's weights: int8 (half the bytes a step streams on a CPU; only the "
                         "proposals change, never the output law), w8a8 (int8 weights and activations, by 8-bit "
                         "dot products: AVX-512 VNNI), none, or auto (w8a8 where the CPU has VNNI, else int8, for "
                         "a float32 model on a CPU with the native kernels; else none) [SPECDEC_QUANTIZE]")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    with refusing_to_start("draft_service"):
        loop = event_loop.resolve(args.event_loop)
        check_start_settings(args)
    runner = build_runner(args, "draft_service")
    engine = DraftEngine(runner, args.max_sessions, args.max_cache_mb * 2**20)
    engine.sessions.reuse_prefixes = args.prefix_reuse == "on"

    async def run() -> None:
        host = ReplicaHost(args, engine, engine.propose, SERVICE, prog="draft_service")
        servicer = DraftServicer(host)
        await host.serve(lambda server: replica_pb2_grpc.add_DraftServicer_to_server(servicer, server),
                         {"ProposeMux": MuxMethod(servicer.propose, replica_pb2.ProposeCalls, replica_pb2.ProposeAnswer,
                                           replica_pb2.ProposeAnswers)})

    event_loop.run(run(), loop)
