"""How a multiplexed stream cuts many calls of one moment into messages both ends accept."""
from __future__ import annotations

from specdec.grpc_server import MAX_MESSAGE_BYTES
from specdec.internal.v1 import replica_pb2 as rpb
from specdec.mux_server import MESSAGE_BUDGET, split_by_size


def call(i: int, payload: int) -> rpb.VerifyCall:
    return rpb.VerifyCall(id=i, request=rpb.VerifyRequest(
        draft_tokens=[1, 2, 3], distributions=rpb.DraftDistributions(vocab_size=4096, dense_fp16=b"x" * payload)))


def test_runs_keep_the_order_and_stay_within_the_budget():
    calls = [call(i, 300_000 + 1000 * i) for i in range(60)]  # about 19 MB in all
    runs = split_by_size(calls)
    assert [c.id for run in runs for c in run] == list(range(60))
    assert len(runs) > 1
    for run in runs:
        assert rpb.VerifyCalls(calls=run).ByteSize() <= MESSAGE_BUDGET + 16 * len(run)
    assert all(sum(c.ByteSize() for c in run) <= MESSAGE_BUDGET for run in runs)
    assert MESSAGE_BUDGET < MAX_MESSAGE_BYTES


def test_small_calls_share_one_message_and_a_huge_one_goes_alone():
    small = [call(i, 100) for i in range(5)]
    assert split_by_size(small) == [small]
    huge = call(9, MESSAGE_BUDGET + 1)
    runs = split_by_size(small[:2] + [huge] + small[2:])
    assert [[c.id for c in run] for run in runs] == [[0, 1], [9], [2, 3, 4]]
    assert split_by_size([]) == []
