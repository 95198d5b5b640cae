"""The wire encoding of draft distributions (specdec.wire) as its protobuf message, both
ways: the draft server sends it, the orchestrator trims a pre-draft's, the target reads it."""
from __future__ import annotations

from specdec.internal.v1 import replica_pb2
from specdec.wire import EncodedDistributions


def to_pb(enc: EncodedDistributions) -> replica_pb2.DraftDistributions:
    return replica_pb2.DraftDistributions(
        vocab_size=enc.vocab_size, sparse=enc.sparse, dense_fp16=enc.dense_fp16,
        sparse_ids_int32=enc.sparse_ids_int32, sparse_probs_fp16=enc.sparse_probs_fp16,
        row_lengths=enc.row_lengths)


def from_pb(pb: replica_pb2.DraftDistributions) -> EncodedDistributions:
    return EncodedDistributions(pb.vocab_size, pb.sparse, pb.dense_fp16, pb.sparse_ids_int32,
                                pb.sparse_probs_fp16, tuple(pb.row_lengths))
