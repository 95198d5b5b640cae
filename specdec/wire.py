"""The exact wire encoding of draft distributions.

The draft quantises its distributions to fp16 *before* sampling and samples from the
quantised values, so what travels is exactly the law the draft tokens were drawn from:
losslessness holds for what the target receives. Rows travel sparse (token ids +
fp16 probabilities) when that is smaller — always under greedy, top-k or top-p, and often
at temperature 1, where fp16 flushes the long tail to zero — and dense fp16 otherwise.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec import native, sampling
from specdec.draft_rows import DraftRows
from specdec.encoding import EncodedDistributions, sparse_is_smaller


def quantize(probs: torch.Tensor) -> torch.Tensor:
    """[..., V] float probabilities → the fp16 values that travel (as float32)."""
    return probs.half().float()


def encode(q16: torch.Tensor) -> EncodedDistributions:
    """[γ, V] quantised probabilities (output of `quantize`) → the smaller exact encoding.

    On the draft's response path once per call, so it works on one numpy view of the
    rows: a handful of numpy calls cost a few microseconds where as many torch ops cost
    a dispatch each."""
    gamma, vocab = q16.shape
    if q16.device.type != "cpu":
        return _encode_on_device(q16.detach())
    kernels = native.loaded()
    if (kernels is not None and q16.dtype == torch.float32 and q16.device.type == "cpu"
            and q16.is_contiguous()):  # the dense bytes and the counts below in one call, to the bit
        dense, per_row = kernels.encode_fp16_rows(q16.detach())
        if not sparse_is_smaller(sum(per_row), gamma, vocab):
            return EncodedDistributions(vocab_size=vocab, sparse=False, dense_fp16=dense)
    a = q16.detach().cpu().numpy()
    nonzero = a > 0
    per_row = np.count_nonzero(nonzero, axis=1)
    if sparse_is_smaller(int(per_row.sum()), gamma, vocab):
        rows, ids = np.nonzero(nonzero)  # row-major order
        return EncodedDistributions(
            vocab_size=vocab, sparse=True,
            sparse_ids_int32=ids.astype(np.int32).tobytes(),
            sparse_probs_fp16=_to_fp16(a[rows, ids]),
            row_lengths=tuple(per_row.tolist()),
        )
    return EncodedDistributions(vocab_size=vocab, sparse=False, dense_fp16=_to_fp16(a))


def _encode_on_device(q16: torch.Tensor) -> EncodedDistributions:
    """`encode` on a GPU: the entries counted and picked there, and only what travels copied
    to the host, in fp16 (exact: the values are fp16 already), not the float32 [γ, V] rows
    (2 MB a session at γ = 4 and a 128k vocabulary; under top-k, greedy's or a sampled
    one, a few hundred bytes)."""
    gamma, vocab = q16.shape
    nonzero = q16 > 0
    per_row = nonzero.sum(1).tolist()
    if sparse_is_smaller(sum(per_row), gamma, vocab):
        rows, ids = nonzero.nonzero(as_tuple=True)  # row-major order, as numpy's
        return EncodedDistributions(
            vocab_size=vocab, sparse=True,
            sparse_ids_int32=ids.int().cpu().numpy().tobytes(),
            sparse_probs_fp16=q16[rows, ids].half().cpu().numpy().tobytes(),
            row_lengths=tuple(per_row),
        )
    return EncodedDistributions(vocab_size=vocab, sparse=False, dense_fp16=q16.half().cpu().numpy().tobytes())


def _to_fp16(values: np.ndarray) -> bytes:
    """float32 values that are fp16 already → their fp16 bytes, cast by torch (vectorised:
    numpy casts fp16 one element at a time, 110 µs for a [4, 4096] block here against 3)."""
    return torch.from_numpy(values).half().numpy().tobytes()


def _fp16(data: bytes) -> torch.Tensor:
    """fp16 bytes → a float64 tensor, converted by torch (vectorised; numpy's fp16 casts
    cost 140 µs for a [4, 4096] block here, against 20 µs). The copy into a bytearray gives
    torch the writable buffer it wants."""
    return torch.frombuffer(bytearray(data), dtype=torch.float16).double()


class WireFormatError(ValueError):
    pass


def decode(enc: EncodedDistributions, gamma: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """→ [γ, V] float64 distributions, normalised exactly as the draft's sampler weighs them."""
    V = _vocab(enc)
    if enc.sparse:  # built in numpy: a few calls, not a torch dispatch each (hot path)
        lengths, ids = _sparse_entries(enc, gamma)
        a = np.zeros((gamma, V), dtype=np.float64)  # few values: numpy's slow fp16 cast is cheap here
        a[np.repeat(np.arange(gamma), lengths), ids] = np.frombuffer(enc.sparse_probs_fp16, dtype=np.float16)
        q = torch.from_numpy(a)
    else:
        _check_dense(enc, gamma)
        kernels = native.loaded()
        if kernels is not None:  # the lines below in one call, to the bit (tests/specdec/test_wire.py)
            try:
                return kernels.decode_fp16_rows(enc.dense_fp16, gamma, V).to(device)
            except ValueError as exc:
                raise WireFormatError(str(exc)) from None
        q = _fp16(enc.dense_fp16).view(gamma, V)
    sums = _checked_sums(q)[:, None]
    return (q / sums).to(device)


def decode_half(enc: EncodedDistributions, gamma: int) -> DraftRows:
    """`decode`'s rows kept fp16 beside their sums (specdec/draft_rows.py), with its checks
    and refusals: for a target whose verdicts run on a GPU, which reads a few values and a
    few rows of them, and moves a quarter of the bytes to the device."""
    V = _vocab(enc)
    if enc.sparse:
        lengths, ids = _sparse_entries(enc, gamma)
        values = torch.zeros(gamma, V, dtype=torch.float16)
        values[torch.from_numpy(np.repeat(np.arange(gamma), lengths)), torch.from_numpy(ids.astype(np.int64))] = \
            torch.from_numpy(np.frombuffer(enc.sparse_probs_fp16, dtype=np.float16).copy())
    else:
        _check_dense(enc, gamma)
        if not gamma:
            return DraftRows(torch.zeros(0, V, dtype=torch.float16), torch.zeros(0, dtype=torch.float64))
        values = torch.frombuffer(bytearray(enc.dense_fp16), dtype=torch.float16).view(gamma, V)
    kernels = native.loaded()
    if kernels is not None and gamma:  # the sums below in one pass over the fp16 values, to the bit
        try:
            return DraftRows(values, kernels.fp16_row_sums(values))
        except ValueError as exc:
            raise WireFormatError(str(exc)) from None
    return DraftRows(values, _checked_sums(values.double()))


def _vocab(enc: EncodedDistributions) -> int:
    if enc.vocab_size <= 0:
        raise WireFormatError("draft distributions carry no vocabulary size")
    return enc.vocab_size


def _sparse_entries(enc: EncodedDistributions, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """A sparse encoding's checked layout → (its rows' lengths, its token ids)."""
    V = enc.vocab_size
    lengths = np.asarray(enc.row_lengths, dtype=np.int64)
    if len(lengths) != gamma or (gamma and (lengths.min() < 1 or lengths.max() > V)):
        raise WireFormatError(f"sparse draft distributions need {gamma} rows of 1..{V} entries")
    total = int(lengths.sum())
    if len(enc.sparse_ids_int32) != 4 * total or len(enc.sparse_probs_fp16) != 2 * total:
        raise WireFormatError("sparse draft distributions: byte lengths do not match row_lengths")
    ids = np.frombuffer(enc.sparse_ids_int32, dtype=np.int32)
    if total and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise WireFormatError(f"sparse draft distributions: token id outside 0..{V - 1}")
    return lengths, ids


def _check_dense(enc: EncodedDistributions, gamma: int) -> None:
    expected = 2 * gamma * enc.vocab_size
    if len(enc.dense_fp16) != expected:
        raise WireFormatError(f"dense draft distributions need {expected} bytes, got {len(enc.dense_fp16)}")


def _checked_sums(q: torch.Tensor) -> torch.Tensor:
    """[γ, V] float64 widened fp16 values → [γ] row sums, summed in sampling.lane_sums'
    order (as specdec.native's decode_fp16_rows and fp16_row_sums sum them), or the refusal
    of a row no law can be."""
    sums = sampling.lane_sums(q)
    # fp16 values are finite (at most 65504) unless inf or NaN, so a row's float64 sum is
    # finite exactly when all its values are: one check over γ sums, not over γ × V values
    if q.shape[0] and (not bool(torch.isfinite(sums).all()) or float(q.amin()) < 0):
        raise WireFormatError("draft distributions hold negative or non-finite values")
    if bool((sums <= 0).any()):
        raise WireFormatError("a draft distribution row has no mass")
    return sums
