"""Log-probabilities of the tokens a generation yields, under the target model.

Reported from the target's raw distribution at each position (the log-softmax of its logits,
before temperature, top-k and top-p), as scoring and evaluation need them: the same number
whatever the request sampled with, and the same as a forward of the target alone over the
text gives (tests/specdec/test_logprobs.py, tests/e2e/test_logprobs.py). The verification's
forward has computed those logits already; only the requesting sessions' kept rows are read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # alternatives per position at most, as common APIs allow


@dataclass(frozen=True)
class TokenLogprob:
    """One yielded token's log-probability, and the `top` most likely (token, log-probability)
    pairs at its position, most likely first."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] (any float dtype), tokens [n] long: the token each row yielded →
    (log-probabilities [n] float32, top ids [n, top] int32, top log-probabilities [n, top]
    float32). Computed in float32 at least, so a bf16 forward's rows round once, at the end."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.to(logp.device).view(-1, 1)).view(-1)
    if top <= 0:
        empty = logp.new_empty(len(tokens), 0)
        return chosen.cpu(), empty.int().cpu(), empty.cpu()
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return chosen.cpu(), ids.int().cpu(), values.cpu()


def records(logprobs: list[float], top_ids: list[int], top_logprobs: list[float], top: int) -> list[TokenLogprob]:
    """The flat fields of a VerifyResponse (or of a stored answer) → one record per token."""
    return [TokenLogprob(lp, tuple(zip(top_ids[i * top:(i + 1) * top], top_logprobs[i * top:(i + 1) * top])))
            for i, lp in enumerate(logprobs)]
