"""The target servicer's decoding of draft distributions: large rows on a worker thread
(the event loop keeps serving meanwhile), small ones inline, the same rows either way and
the same refusals; kept fp16 where its verdicts run on a GPU."""
import asyncio
import threading

import pytest
import torch

from specdec.errors import InvalidRequest
from specdec.wire import encode, quantize
from specdec.wire_pb import to_pb
from target_service import server


def block(gamma: int, vocab: int, keep: int | None = None):
    logits = torch.randn(gamma, vocab, generator=torch.Generator().manual_seed(vocab))
    if keep is not None:
        logits = logits.masked_fill(logits < logits.topk(keep, -1).values[:, -1:], float("-inf"))
    return to_pb(encode(quantize(logits.softmax(-1))))


@pytest.mark.parametrize("vocab,keep,threaded", [(4096, None, False), (128256, None, True), (128256, 50, True)])
def test_large_rows_decode_on_a_worker_thread_to_the_same_rows(vocab, keep, threaded, monkeypatch):
    pb, seen = block(4, vocab, keep), []
    decode = server.decode

    def recording(enc, gamma):
        seen.append(threading.get_ident())
        return decode(enc, gamma)

    monkeypatch.setattr(server, "decode", recording)

    async def main():
        ticks = 0

        async def ticker():  # the loop's other work while a decode runs
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        q = await server.distributions(pb, 4, vocab)
        task.cancel()
        return q, ticks

    q, ticks = asyncio.run(main())
    assert torch.equal(q, server.distributions_from_pb(pb, 4, vocab))
    assert (seen[0] != threading.get_ident()) == threaded
    assert pb.sparse == (keep is not None)
    if threaded:
        assert ticks > 1


def test_a_large_block_refused_on_a_worker_thread_is_refused_as_inline():
    pb = block(4, 128256)
    pb.dense_fp16 = pb.dense_fp16[:-2]
    with pytest.raises(InvalidRequest, match="dense draft distributions need 1026048 bytes, got 1026046"):
        asyncio.run(server.distributions(pb, 4, 128256))
    with pytest.raises(InvalidRequest, match="are over 128256 tokens but the target has 4096"):
        asyncio.run(server.distributions(pb, 4, 4096))


@pytest.mark.parametrize("vocab,keep", [(4096, None), (128256, None), (128256, 50)])
def test_rows_kept_fp16_read_as_the_decoded_rows(vocab, keep):
    """What a GPU's servicer hands its engine (TargetEngine.half_rows): the fp16 values and
    their sums, whose rows are the decoded rows to the bit; the same refusals."""
    from specdec.draft_rows import DraftRows

    pb = block(4, vocab, keep)
    kept = asyncio.run(server.distributions(pb, 4, vocab, half=True))
    decoded = server.distributions_from_pb(pb, 4, vocab)
    assert isinstance(kept, DraftRows) and kept.values.dtype == torch.float16
    assert all(torch.equal(kept.row(i), decoded[i]) for i in range(4))
    assert server.distributions_from_pb(pb, 0, vocab, half=True) is None
    if keep:
        pb.row_lengths[:] = [0, 1, 1, 1]
        refusal = "sparse draft distributions need 4 rows"
    else:
        pb.dense_fp16 = pb.dense_fp16[:-2]
        refusal = "bytes, got"
    with pytest.raises(InvalidRequest, match=refusal):
        asyncio.run(server.distributions(pb, 4, vocab, half=True))

