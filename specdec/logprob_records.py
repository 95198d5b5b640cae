"""A yielded token's log-probability record, and its bytes as stored beside a request's
committed tokens (specdec/session_store.py) for a retry to send again.

Torch-free: the orchestrator assembles and stores these records but computes none; the
target computes them (specdec/logprobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # alternatives per position at most, as common APIs allow


@dataclass(frozen=True)
class TokenLogprob:
    """One yielded token's log-probability, and the `top` most likely (token, log-probability)
    pairs at its position, most likely first."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
