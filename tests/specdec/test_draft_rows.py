"""Draft rows kept fp16 (specdec/draft_rows.py, specdec.wire.decode_half) read as the float64
rows specdec.wire.decode gives, to the bit, natively or by torch's operators alike."""
import pytest
import torch

from specdec import sampling
from specdec.draft_rows import DraftRows, law_at, law_rows
from specdec.encoding import EncodedDistributions
from specdec.wire import WireFormatError, decode, decode_half, encode
from tests.specdec.test_wire import _dense, _rows, _spoiled


@pytest.mark.parametrize("vocab,keep", [(4096, None), (4099, None), (5, None), (4096, 40), (64, 30)])
def test_kept_rows_read_as_decoded_rows_to_the_bit(both_ways, isa, vocab, keep):
    q16 = _rows(6, vocab, keep, seed=vocab + (keep or 0))
    q16[2] = 0.0
    q16[2, -1] = 0.75  # mass only in the last, partial lane
    enc = encode(q16)
    assert enc.sparse == (keep is not None and keep * 3 < vocab)
    want = decode(enc, 6)
    for rows in both_ways(decode_half, enc, 6):
        assert isinstance(rows, DraftRows) and rows.shape == (6, vocab) and rows.values.dtype == torch.float16
        assert torch.equal(rows.sums, sampling.lane_sums(q16.double()))  # decode divides by these
        for i in range(6):
            assert torch.equal(rows.row(i), want[i])
        tokens = torch.randint(vocab, (6,), generator=torch.Generator().manual_seed(1)).tolist()
        assert torch.equal(law_at(rows, tokens), want[torch.arange(6), torch.tensor(tokens)])
        assert torch.equal(law_at(rows, tokens[:3]), law_at(want, tokens[:3]))
        picks = [(rows, 4), None, (rows, 0), (rows, 2)]  # None: a bonus row, which has no q
        zero = torch.zeros(vocab, dtype=torch.float64)
        assert torch.equal(law_rows(picks, vocab, torch.device("cpu")), torch.stack([want[4], zero, want[0], want[2]]))


def test_mixed_laws_stack_as_their_decoded_rows():
    """A batch whose laws came both ways (the in-process loop decodes; a GPU servicer keeps
    fp16) gives the same rows."""
    q16 = _rows(3, 300, None, seed=7)
    enc = encode(q16)
    kept, decoded = decode_half(enc, 3), decode(enc, 3)
    got = law_rows([(kept, 1), (decoded, 2), None], 300, torch.device("cpu"))
    assert torch.equal(got, torch.stack([decoded[1], decoded[2], torch.zeros(300, dtype=torch.float64)]))


def test_kept_rows_refuse_what_decode_refuses(both_ways, isa):
    rows = _rows(4, 40, None, seed=3)
    for block, message in _spoiled(rows):
        enc = _dense(block.tolist())
        with pytest.raises(WireFormatError, match=message):
            decode(enc, 4)
        natively, by_operators = both_ways(decode_half, enc, 4)
        assert natively == by_operators and message in natively
    for enc, gamma in ((_dense(rows.tolist()), 3), (EncodedDistributions(0, False), 1),
                       (EncodedDistributions(40, True, b"", b"\0" * 4, b"\0" * 2, (1, 1)), 2)):
        with pytest.raises(WireFormatError) as refused:
            decode(enc, gamma)
        with pytest.raises(WireFormatError, match=str(refused.value)):
            decode_half(enc, gamma)
