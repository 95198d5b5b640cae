"""Domain types as their protobuf messages, both ways: the wire encoding of draft
distributions (specdec.wire), which the draft server sends, the orchestrator trims for a
pre-draft and the target reads; a call's cache reference (specdec.cache_ref.CacheRef),
which the orchestrator sends and both replicas read; and its sampling law
(specdec.sampling_params.SamplingParams), likewise."""
from __future__ import annotations

import math

from specdec.cache_ref import CacheRef
from specdec.encoding import EncodedDistributions
from specdec.errors import InvalidRequest
from specdec.internal.v1 import replica_pb2
from specdec.sampling_params import MAX_BIAS, MAX_BIASED, SamplingParams


def to_pb(enc: EncodedDistributions) -> replica_pb2.DraftDistributions:
    return replica_pb2.DraftDistributions(
        vocab_size=enc.vocab_size, sparse=enc.sparse, dense_fp16=enc.dense_fp16,
        sparse_ids_int32=enc.sparse_ids_int32, sparse_probs_fp16=enc.sparse_probs_fp16,
        row_lengths=enc.row_lengths)


def from_pb(pb: replica_pb2.DraftDistributions) -> EncodedDistributions:
    return EncodedDistributions(pb.vocab_size, pb.sparse, pb.dense_fp16, pb.sparse_ids_int32,
                                pb.sparse_probs_fp16, tuple(pb.row_lengths))


def ref_to_pb(ref: CacheRef) -> replica_pb2.CacheRef:
    return replica_pb2.CacheRef(session_id=ref.session_id, epoch=ref.epoch, start=ref.start,
                                tokens=ref.tokens, resync=ref.resync)


def ref_from_pb(pb: replica_pb2.CacheRef) -> CacheRef:
    return CacheRef(pb.session_id, pb.epoch, pb.start, list(pb.tokens), pb.resync)


def params_to_pb(p: SamplingParams) -> replica_pb2.SamplingParams:
    return replica_pb2.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, penalty_start=p.penalty_start, logit_bias=dict(p.logit_bias),
        banned_ids=p.banned_ids, banned_until=p.banned_until)


def params_from_pb(pb: replica_pb2.SamplingParams) -> SamplingParams:
    """The law a replica is asked to apply, checked (InvalidRequest says what is wrong)."""
    if not math.isfinite(pb.temperature) or pb.temperature < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {pb.temperature}")
    if not (0 < pb.top_p <= 1):
        raise InvalidRequest(f"top_p must lie in (0, 1], got {pb.top_p}")
    if pb.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {pb.top_k}")
    if not (0 <= pb.min_p <= 1):  # a NaN fails this too (and the checks below)
        raise InvalidRequest(f"min_p must lie in [0, 1], got {pb.min_p}")
    repetition = pb.repetition_penalty or 1.0  # unset (0): off
    if not (0 < repetition <= 100) or not all(abs(x) <= 10 for x in (pb.presence_penalty, pb.frequency_penalty)):
        raise InvalidRequest(f"penalties out of range: repetition {pb.repetition_penalty} (0, 100], presence "
                             f"{pb.presence_penalty} and frequency {pb.frequency_penalty} [-10, 10]")
    if pb.penalty_start < 0 or pb.banned_until < 0:
        raise InvalidRequest(f"penalty_start and banned_until must be >= 0, got {pb.penalty_start}, "
                             f"{pb.banned_until}")
    if len(pb.logit_bias) > MAX_BIASED or not all(abs(b) <= MAX_BIAS for b in pb.logit_bias.values()):
        raise InvalidRequest(f"logit_bias takes at most {MAX_BIASED} tokens, each biased by a value in "
                             f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]")
    return SamplingParams(pb.temperature, pb.top_k, pb.top_p, pb.seed, pb.min_p, repetition, pb.presence_penalty,
                          pb.frequency_penalty, pb.penalty_start, tuple(sorted(pb.logit_bias.items())),
                          tuple(pb.banned_ids), pb.banned_until)
