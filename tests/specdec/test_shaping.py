"""The logits' shaping before sampling (specdec/shaping.py): bias, bans until a position,
then penalties, each row at its own position."""
import pytest
import torch

from specdec import shaping
from specdec.errors import InvalidRequest
from specdec.sampling_params import SamplingParams, shapes
from tests.specdec.test_penalties import reference

V = 30


def test_a_bias_is_added_to_every_row():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(logit_bias=((4, 2.5), (7, -100.0)))
    out = shaping.shaped(logits, torch.zeros(10, dtype=torch.long), 5, params)
    want = logits.clone()
    want[:, 4] += 2.5
    want[:, 7] -= 100.0
    assert torch.equal(out, want) and shapes(params)


def test_banned_tokens_are_out_of_the_rows_before_their_position_only():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(banned_ids=(0, 9), banned_until=7)
    out = shaping.shaped(logits, torch.zeros(10, dtype=torch.long), 5, params)  # rows predict 5, 6, 7, 8
    assert torch.isinf(out[:2, [0, 9]]).all() and torch.equal(out[2:], logits[2:])
    assert torch.equal(out[:2, 1:9], logits[:2, 1:9])
    assert torch.equal(shaping.shaped(logits, torch.zeros(10, dtype=torch.long), 7, params), logits)
    assert not shapes(SamplingParams(banned_ids=(0,), banned_until=0)) and not shapes(SamplingParams())


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


@pytest.fixture(scope="module")
def kernels():
    from specdec import native

    module = native.module()
    assert module is not None, native.unavailable_reason()
    return module


def _random_case(rng, trial: int):
    """Rows of a session at a random position, its prefix drawn from few tokens or many, and
    a random mixture of bias, bans and penalties."""
    import numpy as np

    vocab = 512
    rows, first = int(rng.integers(1, 10)), int(rng.integers(0, 200))
    ids = rng.integers(0, 40 if trial % 2 else vocab, size=first + rows + 3).astype(np.int64)
    bias = tuple(sorted((int(t), float(rng.normal() * 5))
                        for t in rng.choice(vocab, size=int(rng.integers(0, 4)), replace=False)))
    params = SamplingParams(
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.7])), presence_penalty=float(rng.choice([0.0, 0.4, -1.1])),
        frequency_penalty=float(rng.choice([0.0, 0.3, 1.7])), penalty_start=int(rng.integers(0, first + 1)),
        logit_bias=bias, banned_ids=tuple(int(t) for t in rng.choice(40, 3, replace=False)),
        banned_until=int(rng.integers(0, first + rows + 2)))
    logits = torch.from_numpy(rng.normal(size=(rows, vocab)).astype(np.float32) * 4)
    logits[0, 3] = float("-inf")  # a row a bias or ban has taken a token from already
    return logits, ids, first, params


def test_the_native_shaping_is_the_operators_to_the_bit(kernels):
    """specdec.native's shape_rows (what `shaped` runs where the kernels are loaded, and the
    native drafts call per step) against the torch and numpy reference: the same float32
    bits, over 300 random mixtures of bias, bans, penalties, positions and prefixes."""
    import numpy as np

    rng = np.random.default_rng(0)
    for trial in range(300):
        logits, ids, first, params = _random_case(rng, trial)
        want = shaping.shaped_by_operators(logits.clone(), ids, first, params)
        got = logits.clone()
        kernels.shape_rows(got, torch.from_numpy(ids), first, shaping.native_shaping(params))
        assert torch.equal(got, want), (trial, params)
        assert torch.equal(shaping.shaped(logits, ids, first, params), want)  # the path it takes once loaded
    assert not kernels.Shaping().active() and shaping.native_shaping(SamplingParams(repetition_penalty=1.1)).active()


def test_the_native_shaping_refuses_what_it_cannot_shape(kernels):
    law = shaping.native_shaping(SamplingParams(repetition_penalty=1.2))
    logits = torch.zeros(2, V)
    with pytest.raises(RuntimeError, match="ids for rows"):
        kernels.shape_rows(logits, torch.zeros(3, dtype=torch.long), 5, law)  # the rows have seen 6
    with pytest.raises(RuntimeError, match="outside"):
        kernels.shape_rows(logits, torch.full((8,), V, dtype=torch.long), 5, law)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.shape_rows(logits, torch.zeros(8, dtype=torch.long), 5,
                           shaping.native_shaping(SamplingParams(logit_bias=((V, 1.0),))))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.shape_rows(logits.double(), torch.zeros(8, dtype=torch.long), 5, law)
    with pytest.raises(RuntimeError, match="one bias value"):
        kernels.Shaping([1, 2], [1.0], [], 0, 1.0, 0.0, 0.0, 0)
    assert torch.equal(logits, torch.zeros(2, V))  # nothing half-shaped
