"""Repetition, presence and frequency penalties: laws that depend on the tokens before each
position, applied to a verification's logits row by row.

A penalised law is still one law per position, a function of the prefix only, so the
acceptance rule stays exact as long as each row is penalised by the counts of *its* prefix:
the committed tokens, then the draft tokens before it (`penalise_`). Semantics as common
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

from specdec.sampling_params import SamplingParams


def penalise_(out: torch.Tensor, ids: torch.Tensor | np.ndarray, first: int, params: SamplingParams) -> None:
    """Penalise, in place, [rows, V] float logits of one session, the rows predicting
    positions first .. first+rows-1, its token at each earlier position in `ids` (KVCache.ids:
    the fed and draft tokens written). Row r has seen ids[:first + r].

    Only the tokens seen are touched: their counts per row are a [rows, K] table over the K
    distinct tokens of the prefix (one bincount of the common prefix, then a running sum over
    the rows' own steps), and the logits change in those K columns only."""
    rows = out.shape[0]
    seq = np.asarray(ids[:first + rows - 1])
    if len(seq) == 0:
        return
    uniq, inv = np.unique(seq, return_inverse=True)
    in_answer = (np.arange(len(seq)) >= params.penalty_start).astype(np.float64)
    whole = _running_counts(inv, np.ones(len(seq)), first, rows, len(uniq))
    answer = _running_counts(inv, in_answer, first, rows, len(uniq))
    cols = torch.from_numpy(uniq).to(out.device)
    seen = out[:, cols].cpu().numpy()  # [rows, K]: a few small numpy operations, not torch's dispatch each
    if params.repetition_penalty != 1.0:
        theta = np.float32(params.repetition_penalty)
        seen = np.where(whole > 0, np.where(seen > 0, seen / theta, seen * theta), seen)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        seen = seen - np.float32(params.frequency_penalty) * answer - np.float32(params.presence_penalty) * (answer > 0)
    out[:, cols] = torch.from_numpy(seen.astype(np.float32)).to(out.device, out.dtype)


def _running_counts(inv: np.ndarray, weights: np.ndarray, first: int, rows: int, k: int) -> np.ndarray:
    """[rows, k]: row r counts, with `weights`, the tokens (as indices into the distinct
    ones) at positions < first + r."""
    table = np.empty((rows, k))
    table[0] = np.bincount(inv[:first], weights=weights[:first], minlength=k)
    if rows > 1:
        steps = np.zeros((rows - 1, k))
        steps[np.arange(rows - 1), inv[first:first + rows - 1]] = weights[first:first + rows - 1]
        table[1:] = table[0] + steps.cumsum(0)
    return table
