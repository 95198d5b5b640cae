"""Domain types as their protobuf messages, both ways: the wire encoding of draft
distributions (specdec.wire), which the draft server sends, the orchestrator trims for a
pre-draft and the target reads; and a call's cache reference (specdec.sessions.CacheRef),
which the orchestrator sends and both replicas read."""
from __future__ import annotations

from specdec.internal.v1 import replica_pb2
from specdec.sessions import CacheRef
from specdec.wire import EncodedDistributions


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
