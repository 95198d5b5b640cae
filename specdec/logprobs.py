"""Log-probabilities of the tokens a generation yields, under the target model.

Reported from the target's raw distribution at each position (the log-softmax of its logits,
before temperature, top-k and top-p), as scoring and evaluation need them: the same number
whatever the request sampled with, and the same as a forward of the target alone over the
text gives (tests/specdec/test_logprobs.py, tests/e2e/test_logprobs.py). The verification's
forward has computed those logits already; only the requesting sessions' kept rows are read.
Or, where a request asks for them processed, from the law its tokens were sampled from (after
its logits' shaping, specdec/shaping.py, then temperature, top-k, top-p and min-p; −inf outside its support; greedy: 0 for the argmax), as
a policy-gradient trainer needs the sampler's own probabilities (`processed_rows`).
"""
from __future__ import annotations

import torch

from specdec import sampling


def processed_rows(logits: torch.Tensor, params: list[sampling.SamplingParams]) -> torch.Tensor:
    """[n, V] logits, one law per row → [n, V] log-probabilities of those laws, as
    `token_logprobs` takes logits (their log-softmax is themselves: each row's mass is 1)."""
    return torch.log(sampling.probs_rows(logits, params))


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
