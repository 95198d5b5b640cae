"""Repetition, presence and frequency penalties (specdec/penalties.py), row by row against
transformers' repetition processor and a direct count of each row's own prefix."""
from dataclasses import replace

import pytest
import torch

from specdec.penalties import penalise_
from specdec.sampling_params import SamplingParams, penalises

V = 40


def penalise(logits: torch.Tensor, ids, first: int, params: SamplingParams) -> torch.Tensor:
    """penalise_ on a copy."""
    out = logits.clone()
    penalise_(out, ids, first, params)
    return out


def reference(logits_row: torch.Tensor, prefix: list[int], start: int, params: SamplingParams) -> torch.Tensor:
    """One row, counted from its prefix alone, written the plain way."""
    out = logits_row.clone()
    for t in set(prefix):
        if params.repetition_penalty != 1.0:
            x = out[t]
            out[t] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for t in set(prefix[start:]):
        n = prefix[start:].count(t)
        out[t] -= params.frequency_penalty * n + params.presence_penalty
    return out


@pytest.mark.parametrize("start", [0, 5, 9, 12])
@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.7),
                                    SamplingParams(frequency_penalty=0.4),
                                    SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5,
                                                   frequency_penalty=1.1)])
def test_each_row_is_penalised_by_the_counts_of_its_own_prefix(params, start):
    g = torch.Generator().manual_seed(start)
    ids = torch.randint(0, 8, (14,), generator=g)  # few distinct tokens: many repeats
    first, rows = 9, 5  # rows predict positions 9 .. 13, the last four tokens being their steps
    logits = torch.randn(rows, V, generator=g) * 3
    params = replace(params, penalty_start=start)
    got = penalise(logits, ids, first, params)
    for r in range(rows):
        prefix = ids[:first + r].tolist()
        assert torch.allclose(got[r], reference(logits[r], prefix, start, params), atol=1e-6), r
        assert torch.equal(penalise(logits[r:r + 1], ids, first + r, params)[0], got[r])  # alone, as the draft


def test_repetition_is_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (20,), generator=g)
    logits = torch.randn(1, V, generator=g) * 2
    theirs = RepetitionPenaltyLogitsProcessor(1.4)(ids[None], logits.clone())
    assert torch.allclose(penalise(logits, ids, 20, SamplingParams(repetition_penalty=1.4)), theirs)


def test_only_set_penalties_count():
    assert not penalises(SamplingParams(temperature=0.5, top_k=3, min_p=0.1))
    assert penalises(SamplingParams(repetition_penalty=1.1)) and penalises(SamplingParams(frequency_penalty=-0.1))
