"""The logits' shaping before sampling (specdec/shaping.py): bias, bans until a position,
then penalties, each row at its own position."""
import pytest
import torch

from specdec import shaping
from specdec.errors import InvalidRequest
from specdec.sampling import SamplingParams
from tests.specdec.test_penalties import reference

V = 30


def test_a_bias_is_added_to_every_row():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(logit_bias=((4, 2.5), (7, -100.0)))
    out = shaping.shaped(logits, torch.zeros(10, dtype=torch.long), 5, params)
    want = logits.clone()
    want[:, 4] += 2.5
    want[:, 7] -= 100.0
    assert torch.equal(out, want) and shaping.shapes(params)


def test_banned_tokens_are_out_of_the_rows_before_their_position_only():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(banned_ids=(0, 9), banned_until=7)
    out = shaping.shaped(logits, torch.zeros(10, dtype=torch.long), 5, params)  # rows predict 5, 6, 7, 8
    assert torch.isinf(out[:2, [0, 9]]).all() and torch.equal(out[2:], logits[2:])
    assert torch.equal(out[:2, 1:9], logits[:2, 1:9])
    assert torch.equal(shaping.shaped(logits, torch.zeros(10, dtype=torch.long), 7, params), logits)
    assert not shaping.shapes(SamplingParams(banned_ids=(0,), banned_until=0)) and not shaping.shapes(SamplingParams())


def test_penalties_come_after_the_bias():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (12,), generator=g)
    logits = torch.randn(3, V, generator=g)
    params = SamplingParams(logit_bias=((2, 1.5),), repetition_penalty=1.4, frequency_penalty=0.3, penalty_start=4)
    out = shaping.shaped(logits, ids, 9, params)
    for r in range(3):
        biased = logits[r].clone()
        biased[2] += 1.5
        assert torch.allclose(out[r], reference(biased, ids[:9 + r].tolist(), 4, params), atol=1e-6)


def test_tokens_outside_the_vocabulary_are_refused():
    shaping.check(SamplingParams(logit_bias=((V - 1, 1.0),), banned_ids=(0,)), V)
    for bad in (SamplingParams(logit_bias=((V, 1.0),)), SamplingParams(banned_ids=(-1,))):
        with pytest.raises(InvalidRequest):
            shaping.check(bad, V)
