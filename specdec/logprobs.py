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

from dataclasses import dataclass

import numpy as np
import torch

from specdec import sampling

MAX_TOP = 20  # alternatives per position at most, as common APIs allow


@dataclass(frozen=True)
class TokenLogprob:
    """One yielded token's log-probability, and the `top` most likely (token, log-probability)
    pairs at its position, most likely first."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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


def records(logprobs: list[float], top_ids: list[int], top_logprobs: list[float], top: int) -> list[TokenLogprob]:
    """The flat fields of a VerifyResponse (or of a stored answer) → one record per token."""
    return [TokenLogprob(lp, tuple(zip(top_ids[i * top:(i + 1) * top], top_logprobs[i * top:(i + 1) * top])))
            for i, lp in enumerate(logprobs)]


def record_bytes(top: int) -> int:
    """Bytes a token's stored record takes: its log-probability, `top` ids and theirs."""
    return 4 * (1 + 2 * top)


def pack(scores: list[TokenLogprob], top: int) -> bytes:
    """Records as stored beside a request's committed tokens (session_store.AnswerScores),
    `record_bytes(top)` each, for a retry of the request to send them again."""
    n = len(scores)
    chosen = np.array([s.logprob for s in scores], dtype=np.float32).view(np.int32).reshape(n, 1)
    ids = np.array([[t for t, _ in s.top] for s in scores], dtype=np.int32).reshape(n, top)
    values = np.array([[v for _, v in s.top] for s in scores], dtype=np.float32).view(np.int32).reshape(n, top)
    return np.concatenate([chosen, ids, values], axis=1).tobytes()


def unpack(data: bytes, top: int, count: int) -> list[TokenLogprob] | None:
    """The first `count` records of `pack`'s bytes, or None where fewer are stored."""
    size = record_bytes(top)
    if len(data) < count * size:
        return None
    rows = np.frombuffer(data[:count * size], dtype=np.int32).reshape(count, 1 + 2 * top)
    chosen = rows[:, 0].view(np.float32).tolist()
    ids, values = rows[:, 1:1 + top].tolist(), rows[:, 1 + top:].copy().view(np.float32).tolist()
    return [TokenLogprob(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen, ids, values)]
