"""What a request does to the target's logits before temperature, top-k, top-p and min-p:
a logit bias, tokens banned until the answer is long enough (min_tokens), and the
repetition, presence and frequency penalties (specdec/penalties.py), in that order (as vLLM
applies its logits processors, then its penalties).

Each is a law per position that depends on the position and the tokens before it only,
so the acceptance rule stays exact as long as each row of a verification is shaped by its
own position and prefix (`shaped`); the draft shapes its steps the same way, so that a
request's shaping does not turn into rejections.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from specdec import native, penalties
from specdec.errors import InvalidRequest
from specdec.sampling_params import SamplingParams, penalises


def check(params: SamplingParams, vocab: int) -> None:
    """InvalidRequest where the shaping names tokens the model does not have."""
    named = [t for t, _ in params.logit_bias] + list(params.banned_ids)
    bad = [t for t in named if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"logit_bias and banned token ids must lie in 0..{vocab - 1}; got {bad[0]}")


def shaped(logits: torch.Tensor, ids: torch.Tensor | np.ndarray, first: int, params: SamplingParams
           ) -> torch.Tensor:
    """[rows, V] logits of one session, the rows predicting positions first .. first+rows-1,
    its token at each earlier position in `ids` → the shaped rows (float32, a new tensor)."""
    out = logits.float().clone()
    shape_(out, ids, first, params)
    return out


def shape_(rows: torch.Tensor, ids: torch.Tensor | np.ndarray, first: int, params: SamplingParams) -> None:
    """`shaped` in place on float32 rows (a slice of a batch's packed logits, say). In one
    call of specdec.native's shape_rows where the kernels are loaded and the rows are a
    contiguous CPU block (6–9 µs a session; `shaped_by_operators` takes 100–190), with the
    same arithmetic, so the same bits."""
    law = native_shaping(params)
    if law is not None and rows.is_cpu and rows.is_contiguous():
        native.loaded().shape_rows(rows, _id_tensor(ids), first, law)
    else:
        shaped_by_operators(rows, ids, first, params)


def shaped_by_operators(out: torch.Tensor, ids: torch.Tensor | np.ndarray, first: int, params: SamplingParams
                        ) -> torch.Tensor:
    """`shaped`'s reference in torch and numpy operators, on `out` (float32) in place: where
    the kernels are not loaded, or the logits live on a GPU."""
    rows = out.shape[0]
    if params.logit_bias:
        at = torch.tensor([t for t, _ in params.logit_bias], device=out.device)
        out[:, at] += torch.tensor([b for _, b in params.logit_bias], device=out.device)
    if params.banned_ids and first < params.banned_until:
        early = min(rows, params.banned_until - first)  # the rows before the answer is long enough
        banned = torch.tensor(params.banned_ids, device=out.device)
        out[:early, banned] = float("-inf")
    if penalises(params):
        penalties.penalise_(out, ids, first, params)
    return out


def native_shaping(params: SamplingParams):
    """The kernels' Shaping for `params` (what shape_rows and a native draft take), or None
    where the kernels are not loaded in this process."""
    kernels = native.loaded()
    return None if kernels is None else _native_law(kernels, params)


@functools.lru_cache(maxsize=4096)
def _native_law(kernels, params: SamplingParams):
    return kernels.Shaping([t for t, _ in params.logit_bias], [b for _, b in params.logit_bias],
                           list(params.banned_ids), params.banned_until, params.repetition_penalty,
                           params.presence_penalty, params.frequency_penalty, params.penalty_start)


def _id_tensor(ids: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(ids) if isinstance(ids, np.ndarray) else ids.to(torch.long)
