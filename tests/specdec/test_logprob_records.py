"""Log-probability records and their stored bytes (specdec/logprob_records.py)."""
import torch

from specdec.logprob_records import TokenLogprob, pack, record_bytes, records, unpack
from specdec.logprobs import token_logprobs


def test_records_split_the_flat_fields_per_token():
    recs = records([-0.5, -1.5], [3, 4, 5, 6], [-0.1, -0.2, -0.3, -0.4], top=2)
    assert recs == [TokenLogprob(-0.5, ((3, -0.1), (4, -0.2))), TokenLogprob(-1.5, ((5, -0.3), (6, -0.4)))]
    assert records([-0.5], [], [], top=0) == [TokenLogprob(-0.5)]


def test_stored_records_unpack_to_what_was_packed_and_a_short_store_says_so():
    chosen, ids, values = token_logprobs(torch.randn(5, 30, generator=torch.Generator().manual_seed(1)),
                                         torch.tensor([1, 2, 3, 4, 5]), top=3)
    recs = records(chosen.tolist(), ids.flatten().tolist(), values.flatten().tolist(), 3)
    data = pack(recs[:2], 3) + pack(recs[2:], 3)  # two rounds, one after the other
    assert len(data) == 5 * record_bytes(3)
    assert unpack(data, 3, 5) == recs and unpack(data, 3, 4) == recs[:4]
    assert unpack(data, 3, 6) is None and unpack(b"", 0, 0) == []
    bare = [TokenLogprob(r.logprob) for r in recs]
    assert unpack(pack(bare, 0), 0, 5) == bare
