"""Draft distributions as they travel (`EncodedDistributions`), and what is done to them
without decoding them: the point masses of a looked-up proposal, the rows of a pre-draft
cut short. Torch-free, as the orchestrator handles them so (specdec/wire.py encodes and
decodes them on the replicas).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EncodedDistributions:
    vocab_size: int
    sparse: bool
    dense_fp16: bytes = b""
    sparse_ids_int32: bytes = b""
    sparse_probs_fp16: bytes = b""
    row_lengths: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.dense_fp16) + len(self.sparse_ids_int32) + len(self.sparse_probs_fp16) + 4 * len(self.row_lengths)


def point_masses(tokens: list[int], vocab: int) -> EncodedDistributions:
    """The law of a proposal drawn by no model (prompt lookup): all the mass of row i on
    tokens[i]. The target then keeps x with chance p(x) and, where it does not, draws from
    p without x, which is the exact rule for such a draft: a sampled session may verify a
    looked-up draft as losslessly as one a draft model drew. Sparse, one entry a row, each
    an fp16 1.0, so it decodes to exact one-hots."""
    if vocab <= 0 or any(not 0 <= t < vocab for t in tokens):
        raise ValueError(f"point masses need token ids in 0..{vocab - 1}")
    return EncodedDistributions(vocab_size=vocab, sparse=True,
                                sparse_ids_int32=np.asarray(tokens, dtype=np.int32).tobytes(),
                                sparse_probs_fp16=np.ones(len(tokens), dtype=np.float16).tobytes(),
                                row_lengths=(1,) * len(tokens))


def drop_first_rows(enc: EncodedDistributions, k: int) -> EncodedDistributions:
    """The same encoding without its first k rows (a pre-drafted continuation whose first
    token turned out to be the committed bonus token)."""
    if enc.sparse:
        skip = sum(enc.row_lengths[:k])
        return EncodedDistributions(enc.vocab_size, True, b"", enc.sparse_ids_int32[4 * skip:],
                                    enc.sparse_probs_fp16[2 * skip:], tuple(enc.row_lengths[k:]))
    return EncodedDistributions(enc.vocab_size, False, enc.dense_fp16[2 * k * enc.vocab_size:])


def sparse_is_smaller(entries: int, gamma: int, vocab: int) -> bool:
    """Whether `entries` positive values as ids and fp16 (6 bytes each) take fewer bytes
    than the dense fp16 block of γ × V (2 bytes each)."""
    return entries * 6 < gamma * vocab * 2
