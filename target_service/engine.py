"""TargetEngine: verifies the drafts of a batch of sessions in one forward pass.

Knows nothing of gRPC. Each session feeds its pending committed tokens plus its γ draft
tokens; acceptance, recovery and the bonus token run on the target's device; the cache is
rolled back to the accepted prefix. No dense target distribution leaves this process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec import sampling
from specdec.errors import CacheMismatch, InvalidRequest, SpecDecError
from specdec.model_runner import ForwardItem, ModelRunner
from specdec.sessions import CacheRef, SessionTable

MAX_GAMMA = 16


@dataclass
class VerifyJob:
    ref: CacheRef
    draft_tokens: list[int]  # [γ], may be empty (target-only decoding)
    q: torch.Tensor | None  # [γ, V] float64 draft distributions, None when γ = 0
    params: sampling.SamplingParams

    @property
    def forward_size(self) -> int:
        """The size of this job's share of the forward: pending tokens plus the draft."""
        return len(self.ref.tokens) + len(self.draft_tokens)


@dataclass
class Verdict:
    accepted: int
    next_token: int
    cache_length: int
    resynced: bool = False
    compute_ms: float = 0.0
    batch_size: int = 1


class TargetEngine:
    def __init__(self, runner: ModelRunner, max_sessions: int = 256, max_cache_bytes: int = 0) -> None:
        self.runner = runner
        self.sessions = SessionTable(runner, max_sessions, max_cache_bytes)
        self.forward_passes = 0
        self.fed_tokens = 0

    def _check(self, job: VerifyJob) -> None:
        gamma = len(job.draft_tokens)
        if gamma > MAX_GAMMA:
            raise InvalidRequest(f"at most {MAX_GAMMA} draft tokens per call, got {gamma}")
        if not job.ref.tokens:
            raise InvalidRequest("verification needs at least one new committed token to feed")
        if gamma and (job.q is None or tuple(job.q.shape) != (gamma, self.runner.vocab_size)):
            raise InvalidRequest(f"draft distributions must have shape [{gamma}, {self.runner.vocab_size}]")
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in job.draft_tokens):
            raise InvalidRequest(f"draft token ids must lie in 0..{vocab - 1}")
        self.sessions.validate(job.ref, extra=gamma)

    def verify(self, jobs: list[VerifyJob]) -> list[Verdict | SpecDecError]:
        t0 = time.perf_counter()
        results: list[Verdict | SpecDecError | None] = [None] * len(jobs)
        busy = {j.ref.session_id for j in jobs}
        last = {j.ref.session_id: i for i, j in enumerate(jobs)}
        live, items, resynced = [], [], {}
        for i, job in enumerate(jobs):
            try:
                if last[job.ref.session_id] != i:
                    raise CacheMismatch(f"session {job.ref.session_id}: two verifications in one batch")
                self._check(job)
                cache, resynced[i] = self.sessions.acquire(job.ref, exact=True, busy=busy)
            except SpecDecError as exc:
                results[i] = exc
                continue
            tokens = torch.tensor(job.ref.tokens + job.draft_tokens, dtype=torch.long)
            items.append(ForwardItem(cache, tokens, len(job.draft_tokens) + 1))
            live.append(i)
        if live:
            logits = self.runner.forward(items)
            self.forward_passes += 1
            self.fed_tokens += sum(len(it.tokens) for it in items)
            verdicts = self._decide([jobs[i] for i in live], logits)
            ms = (time.perf_counter() - t0) * 1000
            for i, item, (n, token) in zip(live, items, verdicts):
                committed = jobs[i].ref.start + len(jobs[i].ref.tokens)
                item.cache.truncate(committed + n)  # keep the accepted prefix; next_token is pending
                results[i] = Verdict(n, token, item.cache.length, resynced[i], ms, len(live))
        return results  # type: ignore[return-value]

    def _decide(self, jobs: list[VerifyJob], logits: list[torch.Tensor]) -> list[tuple[int, int]]:
        """Acceptance for the batch: greedy sessions by argmax, the others by the full rule."""
        out: list[tuple[int, int] | None] = [None] * len(jobs)
        greedy = [b for b, j in enumerate(jobs) if j.params.greedy]
        sampled = [b for b, j in enumerate(jobs) if not j.params.greedy]
        for group, decide in ((greedy, self._decide_greedy), (sampled, self._decide_sampled)):
            if group:
                for b, verdict in zip(group, decide([jobs[b] for b in group], [logits[b] for b in group])):
                    out[b] = verdict
        return out  # type: ignore[return-value]

    def _decide_greedy(self, jobs: list[VerifyJob], logits: list[torch.Tensor]) -> list[tuple[int, int]]:
        """No distributions needed (sampling.verify_greedy): pad and compare argmaxes."""
        B, G = len(jobs), max(len(j.draft_tokens) for j in jobs)
        device = logits[0].device
        argmax = torch.zeros(B, G + 1, dtype=torch.long, device=device)
        draft = torch.full((B, G), -1, dtype=torch.long, device=device)
        for b, (job, rows) in enumerate(zip(jobs, logits)):
            argmax[b, : rows.shape[0]] = rows.argmax(-1)
            if job.draft_tokens:
                draft[b, : len(job.draft_tokens)] = torch.tensor(job.draft_tokens, device=device)
        gammas = torch.tensor([len(j.draft_tokens) for j in jobs], device=device)
        res = sampling.verify_greedy(draft, argmax, gammas)
        return list(zip(res.accepted.tolist(), res.next_token.tolist()))

    def _decide_sampled(self, jobs: list[VerifyJob], logits: list[torch.Tensor]) -> list[tuple[int, int]]:
        """Batched acceptance over sessions padded to the largest γ."""
        B, G, V = len(jobs), max(len(j.draft_tokens) for j in jobs), self.runner.vocab_size
        device = logits[0].device
        p = torch.zeros(B, G + 1, V, dtype=torch.float64, device=device)
        q = torch.zeros(B, G, V, dtype=torch.float64, device=device)
        draft = torch.zeros(B, G, dtype=torch.long, device=device)
        u_acc = torch.zeros(B, G, dtype=torch.float64)
        u_res = torch.zeros(B, G + 1, dtype=torch.float64)
        gammas = torch.tensor([len(j.draft_tokens) for j in jobs], device=device)
        for b, (job, rows) in enumerate(zip(jobs, logits)):
            g = len(job.draft_tokens)
            p[b, : g + 1] = sampling.logits_to_probs(rows, job.params).double()
            first = job.ref.start + len(job.ref.tokens)  # position of the first draft token
            if g:
                q[b, :g] = job.q.to(device)
                draft[b, :g] = torch.tensor(job.draft_tokens, device=device)
                u_acc[b, :g] = sampling.uniforms(job.params.seed, first, g, sampling.STREAM_ACCEPT)
            u_res[b, : g + 1] = sampling.uniforms(job.params.seed, first, g + 1, sampling.STREAM_RESAMPLE)
        res = sampling.verify(draft, q, p, u_acc, u_res, gammas)
        return list(zip(res.accepted.tolist(), res.next_token.tolist()))

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)
