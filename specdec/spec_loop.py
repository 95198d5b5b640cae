"""The in-process speculative loop over a draft and a target engine (no network).

It is the reference the distributed pipeline must match token for token, and a
baseline for the benchmark. With draft=None or gamma=0 it decodes with the target alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from specdec import rounds
from specdec.errors import value_or_raise
from specdec.loop_stats import LoopStats
from specdec.sampling import SamplingParams
from specdec.wire import decode, encode


@dataclass
class LoopResult:
    tokens: list[int]
    stats: LoopStats
    finish_reason: str


def generate(draft, target, prompt_ids: list[int], params: SamplingParams, gamma: int,
             max_new_tokens: int, eos_id: int | None = None, session_id: str = "local",
             through_wire: bool = True) -> LoopResult:
    """Speculative decoding in one process; draft/target are DraftEngine/TargetEngine."""
    from draft_service.engine import ProposeJob
    from target_service.engine import VerifyJob

    committed = list(prompt_ids)
    cur, stats, reason = rounds.Cursor(), LoopStats(), "length"
    max_len = target.runner.max_length
    try:
        while len(committed) - len(prompt_ids) < max_new_tokens:
            m = len(committed)
            if m >= max_len:
                reason = "context"
                break
            g = rounds.plan_gamma(gamma if draft is not None else 0, max_new_tokens - (m - len(prompt_ids)), m, max_len)
            draft_tokens, q = [], None
            if g:
                t0 = time.perf_counter()
                job = ProposeJob(rounds.draft_ref(session_id, 1, committed, cur), g, params)
                prop = value_or_raise(draft.propose([job])[0])
                draft_tokens, q = prop.tokens, prop.q
                if q is not None and through_wire:  # exactly what the distributed pipeline sends
                    q = decode(encode(q), g)
                elif q is not None:  # (greedy has none: the rule compares tokens)
                    q = q.double() / q.double().sum(-1, keepdim=True)
                stats.draft_ms += (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            ref = rounds.target_ref(session_id, 1, committed, cur)
            verdict = value_or_raise(target.verify([VerifyJob(ref, draft_tokens, q, params)])[0])
            stats.verify_ms += (time.perf_counter() - t0) * 1000
            new = rounds.new_tokens(draft_tokens, verdict.accepted, verdict.next_token)
            kept = len(new)
            if eos_id is not None and eos_id in new:
                kept = new.index(eos_id) + 1
                reason = "eos"
            committed.extend(new[:kept])
            cur = rounds.advance(cur, m, g, verdict.accepted, verdict.cache_length, kept)
            stats.observe(g, verdict.accepted)
            if reason == "eos":
                break
    finally:
        if draft is not None:
            draft.release(session_id)
        target.release(session_id)
    return LoopResult(tokens=committed[len(prompt_ids):], stats=stats, finish_reason=reason)
