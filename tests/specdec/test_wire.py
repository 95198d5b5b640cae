"""The wire encoding of draft distributions is exact: what the target decodes is what the
draft sampled from, in sparse and dense form, each row normalised by its sum in
sampling.lane_sums' order, natively or by torch's operators alike."""
import pytest
import torch

from specdec import native, sampling
from specdec.encoding import EncodedDistributions, drop_first_rows, point_masses
from specdec.wire import _encode_on_device, decode, encode, quantize


def _rows(gamma: int, vocab: int, keep: int | None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(gamma, vocab, generator=g) * 3
    if keep is not None:  # top-k truncation: the rest is exactly zero
        cut = logits.topk(keep, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return quantize(logits.softmax(-1))


def _normalised(q16: torch.Tensor) -> torch.Tensor:
    q = q16.double()
    return q / sampling.lane_sums(q)[:, None]


def test_truncated_rows_travel_sparse_and_exact():
    q16 = _rows(4, 4096, keep=20)
    enc = encode(q16)
    assert enc.sparse and enc.row_lengths == (20, 20, 20, 20)
    assert enc.nbytes == 4 * 20 * 6 + 4 * 4
    assert torch.equal(decode(enc, 4), _normalised(q16))


def test_full_rows_travel_dense_and_exact():
    q16 = _rows(3, 512, keep=None)
    enc = encode(q16)
    assert not enc.sparse and enc.nbytes == 3 * 512 * 2
    assert torch.equal(decode(enc, 3), _normalised(q16))


def test_one_hot_rows_and_dropping_rows():
    q16 = torch.zeros(3, 100)
    q16[0, 7] = q16[1, 0] = q16[2, 99] = 1.0
    enc = encode(q16)
    assert enc.sparse and enc.row_lengths == (1, 1, 1)
    tail = drop_first_rows(enc, 1)
    assert torch.equal(decode(tail, 2), q16[1:].double())


def test_the_protobuf_message_carries_the_encoding_exactly():
    from specdec.internal.v1 import replica_pb2
    from specdec.wire_pb import from_pb, to_pb

    for q16 in (_rows(3, 4096, keep=20), _rows(3, 512, keep=None)):
        enc = encode(q16)
        wire = replica_pb2.DraftDistributions.FromString(to_pb(enc).SerializeToString())
        assert from_pb(wire) == enc
        assert torch.equal(decode(from_pb(wire), 3), _normalised(q16))


def _dense(rows: list[list[float]]) -> EncodedDistributions:
    import numpy as np

    a = np.array(rows, dtype=np.float16)
    return EncodedDistributions(vocab_size=a.shape[1], sparse=False, dense_fp16=a.tobytes())


def _spoiled(rows: torch.Tensor):
    """Copies of [γ, V] rows that decode must refuse, each with the refusal's words: a NaN,
    a negative and an infinite value in row 1, and a last row without mass."""
    for bad, message in ((float("nan"), "negative or non-finite"), (-0.5, "negative or non-finite"),
                         (float("inf"), "negative or non-finite"), (None, "no mass")):
        spoiled = rows.clone()
        if bad is None:
            spoiled[-1] = 0.0
        else:
            spoiled[1, 1] = bad
        yield spoiled, message


def test_malformed_distributions_are_refused_with_what_is_wrong():
    """NaN, ±inf or a negative value anywhere, or a row without mass, in either form: the
    target must refuse the call rather than verify against a law that is not one."""
    import pytest

    from specdec.wire import WireFormatError

    for bad in (float("nan"), float("inf"), -float("inf"), -0.25):
        with pytest.raises(WireFormatError, match="negative or non-finite"):
            decode(_dense([[0.5, 0.5, 0.0], [0.2, bad, 0.8]]), 2)
        sparse = EncodedDistributions(3, True, b"", torch.tensor([0, 2], dtype=torch.int32).numpy().tobytes(),
                                      torch.tensor([0.5, bad], dtype=torch.float16).numpy().tobytes(), (2,))
        with pytest.raises(WireFormatError, match="negative or non-finite"):
            decode(sparse, 1)
    with pytest.raises(WireFormatError, match="no mass"):
        decode(_dense([[0.5, 0.5, 0.0], [0.0, -0.0, 0.0]]), 2)
    assert torch.equal(decode(_dense([[0.0, -0.0, 2.0]]), 1), torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("vocab", [4096, 4099, 5])
def test_native_dense_decoding_is_the_operators_to_the_bit(both_ways, isa, vocab):
    """Where specdec.native is loaded, a dense block is decoded in one call of its
    decode_fp16_rows, on every instruction set this CPU has: the same float64 rows as
    torch's operators, and the same refusals."""
    q16 = _rows(6, vocab, keep=None, seed=vocab)
    q16[1, ::3] = 0.0  # zeros inside a row
    q16[2] = 0.0
    q16[2, -1] = 0.75  # mass only in the last, partial lane
    natively, by_operators = both_ways(decode, encode(q16), 6)
    assert not encode(q16).sparse and torch.equal(natively, by_operators)
    assert torch.equal(natively, _normalised(q16))
    for rows, message in _spoiled(q16):
        natively, by_operators = both_ways(decode, _dense(rows.tolist()), 6)
        assert natively == by_operators and message in natively


@pytest.mark.parametrize("vocab,keep", [(4096, None), (4099, None), (5, None), (4096, 40), (64, 30)])
def test_native_encoding_is_the_operators_to_the_bit(monkeypatch, isa, vocab, keep):
    """Where specdec.native is loaded, encode takes a block's dense fp16 bytes and its rows'
    counts of positive values (which choose dense or sparse) from one call of its
    encode_fp16_rows, on every instruction set this CPU has: the same encoding as numpy's
    and torch's calls, dense or sparse, fp16 subnormals and zeros included."""
    q16 = _rows(6, vocab, keep=keep, seed=vocab + (keep or 0))
    if keep is None:
        q16[1, ::3] = 0.0  # zeros inside a row
        q16[2, :] = 0.0
        q16[2, -1] = 2.0 ** -24  # fp16's smallest subnormal, in the last, partial lane
        q16[2, 0] = 2.0 ** -15 + 2.0 ** -20  # a subnormal with several bits
    natively = encode(q16)
    with monkeypatch.context() as patch:
        patch.setattr(native, "loaded", lambda: None)
        by_operators = encode(q16)
    assert natively == by_operators
    assert natively.sparse == (keep is not None and keep * 3 < vocab)
    assert torch.equal(decode(natively, 6), _normalised(q16))
    assert encode(q16.t().contiguous().t()) == by_operators  # a strided block takes the operators


@pytest.mark.parametrize("vocab,keep", [(4096, None), (4096, 40), (64, 30), (5, None)])
def test_the_gpu_encoding_is_the_hosts_to_the_bit(vocab, keep):
    """On a GPU the draft counts and picks the entries on the device and copies only what
    travels (`_encode_on_device`, run here on CPU tensors): the same bytes as on a CPU,
    dense or sparse, fp16 subnormals and zeros included."""
    q16 = _rows(6, vocab, keep=keep, seed=vocab + 7)
    if keep is None:
        q16[1, ::3] = 0.0
        q16[2, :] = 0.0
        q16[2, -1] = 2.0 ** -24
        q16[2, 0] = 2.0 ** -15 + 2.0 ** -20
    assert _encode_on_device(q16) == encode(q16)
    assert _encode_on_device(q16).sparse == (keep is not None and keep * 3 < vocab)


def test_point_masses_decode_to_exact_one_hots_and_refuse_tokens_outside_the_vocabulary():
    """Prompt lookup's draft law (a sampled session's looked-up tokens): one sparse entry a
    row, an fp16 1.0, decoded to exact one-hots."""

    tokens = [7, 0, 4095, 7]
    enc = point_masses(tokens, 4096)
    assert enc.sparse and enc.row_lengths == (1, 1, 1, 1) and enc.nbytes == 4 * 6 + 4 * 4
    want = torch.zeros(4, 4096, dtype=torch.float64)
    want[torch.arange(4), torch.tensor(tokens)] = 1.0
    assert torch.equal(decode(enc, 4), want)
    assert point_masses([], 4096).row_lengths == ()
    for bad, vocab in (([4096], 4096), ([-1], 4096), ([0], 0)):
        with pytest.raises(ValueError, match="point masses"):
            point_masses(bad, vocab)
