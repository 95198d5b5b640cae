"""Repetition, presence and frequency penalties: laws that depend on the tokens before each
position, applied to a verification's logits row by row.

A penalised law is still one law per position, a function of the prefix only, so the
acceptance rule stays exact as long as each row is penalised by the counts of *its* prefix:
the committed tokens, then the draft tokens before it (`row_counts`). Semantics as common
servers have them:
- repetition (transformers' `RepetitionPenaltyLogitsProcessor`, vLLM's): over every token of
  the context, prompt included, a seen token's logit is divided by θ where positive and
  multiplied by θ where negative;
- presence and frequency (OpenAI's, vLLM's): over the answer's tokens only (from the
  request's `penalty_start`), a seen token's logit loses `presence` once and `frequency`
  per occurrence.
They come before temperature, top-k, top-p and min-p, as in `generate()` and vLLM.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.sampling import SamplingParams


def penalises(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def row_counts(ids: torch.Tensor | np.ndarray, first: int, rows: int, start: int, vocab: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: a session's token at each position (KVCache.ids, the fed and draft tokens
    written); the rows that predict positions first .. first+rows-1 → (the count of each
    token in each row's prefix, [rows, V]; the same counting only positions ≥ `start`, the
    answer's) as float32. Row r has seen ids[:first + r]: one bincount of the common prefix,
    then a running sum over the row's own steps."""
    ids = torch.as_tensor(ids[:first + rows - 1])  # a view of the cache's array, no copy
    whole = torch.bincount(ids[:first], minlength=vocab).float()
    answer = torch.bincount(ids[min(start, first):first], minlength=vocab).float()
    steps = torch.zeros(rows, vocab)
    if rows > 1:
        at = torch.arange(1, rows)
        steps[at, ids[first:first + rows - 1]] = 1.0
        counted = (first + at - 1 >= start).float()  # a step in the answer counts there too
        answer_steps = torch.zeros(rows, vocab)
        answer_steps[at, ids[first:first + rows - 1]] = counted
        return whole + steps.cumsum(0), answer + answer_steps.cumsum(0)
    return whole + steps, answer + steps


def penalised(logits: torch.Tensor, whole: torch.Tensor, answer: torch.Tensor, params: SamplingParams
              ) -> torch.Tensor:
    """[n, V] logits of one session's rows, with `row_counts`' counts → the penalised logits
    (float32, a new tensor)."""
    out = logits.float().clone()
    whole, answer = whole.to(out.device), answer.to(out.device)
    if params.repetition_penalty != 1.0:
        theta = params.repetition_penalty
        hit = whole > 0
        out = torch.where(hit, torch.where(out > 0, out / theta, out * theta), out)
    if params.frequency_penalty != 0.0:
        out = out - params.frequency_penalty * answer
    if params.presence_penalty != 0.0:
        out = out - params.presence_penalty * (answer > 0).float()
    return out
