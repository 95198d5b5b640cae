"""A request's sampling parameters, and what they ask of the rows a model gives.

Torch-free on purpose: the orchestrator validates these parameters and sends them on, but
computes no law, and its process imports no torch (orchestrator/__main__.py). The laws
themselves are specdec/sampling.py's, the shaping of the logits specdec/shaping.py's and
specdec/penalties.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does)
MAX_BIAS = 100.0  # as OpenAI's logit_bias
MAX_BIASED = 300  # tokens a request may bias


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = no truncation
    top_p: float = 1.0  # 1.0 = no truncation
    seed: int = 0
    min_p: float = 0.0  # 0 = no truncation; else drop tokens below min_p × the most likely one's probability
    # penalties on the tokens before each position (specdec/penalties.py), before all of the above
    repetition_penalty: float = 1.0  # 1 = off; over the whole context
    presence_penalty: float = 0.0  # 0 = off; over the answer's tokens (positions ≥ penalty_start)
    frequency_penalty: float = 0.0
    penalty_start: int = 0  # where the answer starts in the session
    # added to the logits before the penalties (specdec/shaping.py): (token, bias) pairs, sorted
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned_ids: tuple[int, ...] = ()  # these tokens cannot come at positions < banned_until (min_tokens)
    banned_until: int = 0

    @property
    def greedy(self) -> bool:
        # the T → 0 limit; logits divided by a smaller T overflow float32 (NaN probabilities)
        return self.temperature < GREEDY_BELOW

    @property
    def truncates(self) -> bool:
        return self.greedy or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def penalises(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def shapes(params: SamplingParams) -> bool:
    """Whether the request shapes its logits at all (most do not: their rows go untouched)."""
    return bool(params.logit_bias) or (bool(params.banned_ids) and params.banned_until > 0) \
        or penalises(params)
