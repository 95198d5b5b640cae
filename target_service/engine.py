"""TargetEngine: verifies the drafts of a batch of sessions in one forward pass.

Knows nothing of gRPC. Each session feeds its pending committed tokens plus its γ draft
tokens; acceptance, recovery and the bonus token run on the target's device; the cache is
rolled back to the accepted prefix. No dense target distribution leaves this process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate

import torch

from specdec import logprobs as lp
from specdec import native, sampling, shaping
from specdec.draft_rows import Law, law_at, law_rows
from specdec.errors import CacheMismatch, InvalidRequest, SpecDecError
from specdec.logprob_records import MAX_TOP
from specdec.model_runner import ForwardItem, ModelRunner
from specdec.sampling_params import shapes
from specdec.sessions import CacheRef, SessionTable

MAX_GAMMA = 16


@dataclass
class VerifyJob:
    ref: CacheRef
    draft_tokens: list[int]  # [γ], may be empty (target-only decoding)
    # [γ, V] draft distributions, float64 or kept fp16 (specdec/draft_rows.py: a GPU's); None
    # when γ = 0, may be None when greedy
    q: Law | None
    params: sampling.SamplingParams
    logprobs: bool = False  # return the kept tokens' log-probabilities (specdec/logprobs.py)
    top_logprobs: int = 0  # and this many most likely tokens at each of their positions
    fed_logprobs: bool = False  # and those of ref.tokens[1:] (a prompt's), from the rows that predict them
    processed: bool = False  # of the sampled law (temperature, top-k, top-p, min-p), not the raw one

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
    batch_tokens: int = 0  # rows of the forward: what the orchestrator's cost curve is keyed by
    # sampled drafts: per draft position i = 1..γ, the rule's chance that a prefix of i is kept
    # (sampling.token_keep_chances_row, or the block weights); greedy: None (the kept length tells all)
    keep_chances: list[float] | None = None
    # with VerifyJob.logprobs, per kept token (accepted, then next_token): its log-probability
    # under the target, and top_logprobs (token, log-probability) pairs each, flat
    logprobs: list[float] | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    # with VerifyJob.fed_logprobs, the same for the fed tokens after the first
    fed_logprobs: list[float] | None = None
    fed_top_ids: list[int] | None = None
    fed_top_logprobs: list[float] | None = None


class TargetEngine:
    def __init__(self, runner: ModelRunner, max_sessions: int = 256, max_cache_bytes: int = 0,
                 rule: str = "block") -> None:
        if rule not in sampling.RULES:
            raise ValueError(f"verification rule must be one of {sampling.RULES}, got {rule!r}")
        self.runner = runner
        self.rule = rule  # how sampled drafts are verified (specdec.sampling); greedy is the same
        self.native_verdicts = True  # block verdicts by specdec.native where loaded (off: to measure it)
        self.sessions = SessionTable(runner, max_sessions, max_cache_bytes)
        self.forward_passes = 0
        self.fed_tokens = 0

    @property
    def half_rows(self) -> bool:
        """Whether the servicer keeps the draft's rows fp16 until they are read
        (specdec/draft_rows.py): where the verdicts run on a device; on a CPU they are
        decoded, as the native verdicts read them."""
        return self.runner.device.type != "cpu"

    def _check(self, job: VerifyJob) -> None:
        gamma = len(job.draft_tokens)
        if gamma > MAX_GAMMA:
            raise InvalidRequest(f"at most {MAX_GAMMA} draft tokens per call, got {gamma}")
        if not job.ref.tokens:
            raise InvalidRequest("verification needs at least one new committed token to feed")
        if job.q is None and gamma and not job.params.greedy:
            raise InvalidRequest(f"sampling at temperature {job.params.temperature} needs the draft's "
                                 f"distributions: [{gamma}, {self.runner.vocab_size}]")
        if job.q is not None and tuple(job.q.shape) != (gamma, self.runner.vocab_size):
            raise InvalidRequest(f"draft distributions must have shape [{gamma}, {self.runner.vocab_size}]")
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in job.draft_tokens):
            raise InvalidRequest(f"draft token ids must lie in 0..{vocab - 1}")
        shaping.check(job.params, vocab)
        if not 0 <= job.top_logprobs <= MAX_TOP or job.top_logprobs and not (job.logprobs or job.fed_logprobs):
            raise InvalidRequest(f"top_logprobs must lie in 0..{MAX_TOP}, and needs logprobs or fed_logprobs")
        self.sessions.validate(job.ref, extra=gamma)

    def verify(self, jobs: list[VerifyJob]) -> list[Verdict | SpecDecError]:
        """One batch of verifications in one forward pass over every session's pending tokens
        and draft; each gets its verdict (accepted length, next token) with its cache cut to
        the kept prefix, and a bad job its error, the rest going on."""
        t0 = time.perf_counter()
        results, live, caches, resynced = self._admit(jobs)
        items = []
        for i, cache in zip(live, caches):
            job = jobs[i]
            fed = job.ref.tokens + job.draft_tokens
            cache.write_ids(job.ref.start, fed)
            tokens = torch.tensor(fed[cache.length - job.ref.start:], dtype=torch.long)
            items.append(ForwardItem(cache, tokens, len(tokens) if job.fed_logprobs else len(job.draft_tokens) + 1))
        if live:
            logits = self.runner.forward_packed(items)  # [Σ (γ + 1), V]
            self.forward_passes += 1
            rows = sum(len(it.tokens) for it in items)
            self.fed_tokens += rows
            logits, fed = self._split_fed_rows([jobs[i] for i in live], items, logits)
            laws = self._shaped([jobs[i] for i in live], items, logits)
            verdicts = self._decide([jobs[i] for i in live], laws)
            scores = self._logprobs([jobs[i] for i in live], logits, laws, verdicts)
            ms = (time.perf_counter() - t0) * 1000
            for i, item, (n, token, chances), score, fed_score in zip(live, items, verdicts, scores, fed):
                committed = jobs[i].ref.start + len(jobs[i].ref.tokens)
                item.cache.truncate(committed + n)  # keep the accepted prefix; next_token is pending
                results[i] = Verdict(n, token, item.cache.length, resynced[i], ms, len(live), rows, chances, *score,
                                     *fed_score)
        return results  # type: ignore[return-value]

    def _admit(self, jobs: list[VerifyJob]) -> tuple[list, list[int], list, dict[int, bool]]:
        """Validate every job and take its cache: → (results with each refused job's error in
        its place, the indices of the jobs that go on, their caches, whether each was
        resynced), then room made for the batch's growth at once. A new session may start
        from another's copied prefix, unless every fed row's scores are asked for."""
        results: list[Verdict | SpecDecError | None] = [None] * len(jobs)
        busy = {j.ref.session_id for j in jobs}
        last = {j.ref.session_id: i for i, j in enumerate(jobs)}
        live, caches, resynced = [], [], {}
        for i, job in enumerate(jobs):
            try:
                if last[job.ref.session_id] != i:
                    raise CacheMismatch(f"session {job.ref.session_id}: two verifications in one batch")
                self._check(job)
                cache, resynced[i] = self.sessions.acquire(job.ref, exact=True, busy=busy,
                                                           reuse=not job.fed_logprobs)
            except SpecDecError as exc:
                # a refusal travels as a value: without its traceback, which would hold this
                # frame (the batch's logits and caches) in a cycle until the cyclic GC ran
                results[i] = exc.with_traceback(None)
                continue
            caches.append(cache)
            live.append(i)
        self.sessions.make_room([(cache, jobs[i].ref.start + jobs[i].forward_size)
                                 for i, cache in zip(live, caches)], busy)
        return results, live, caches, resynced

    @staticmethod
    def _split_fed_rows(jobs: list[VerifyJob], items: list[ForwardItem],
                        logits: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        """Where jobs asked for their fed tokens' log-probabilities (their forward computed
        every row): → (each job's last γ + 1 rows, which the verdicts read, packed as usual;
        per job (log-probabilities, top ids, top log-probabilities) of ref.tokens[1:], from the
        rows before them, or (None, None, None))."""
        out: list[tuple] = [(None, None, None)] * len(jobs)
        if not any(j.fed_logprobs for j in jobs):
            return logits, out
        keep, at = [], 0
        for b, (job, item) in enumerate(zip(jobs, items)):
            gamma, fed = len(job.draft_tokens), len(job.ref.tokens)
            if job.fed_logprobs:
                rows = logits[at:at + fed - 1]
                if job.processed:
                    if shapes(job.params):
                        rows = shaping.shaped(rows, item.cache.ids, job.ref.start + 1, job.params)
                    rows = lp.processed_rows(rows, [job.params] * len(rows))
                chosen, ids, values = lp.token_logprobs(rows, torch.tensor(job.ref.tokens[1:], dtype=torch.long),
                                                        job.top_logprobs)
                out[b] = chosen.tolist(), ids.flatten().tolist(), values.flatten().tolist()
            at += item.logits_rows
            keep.extend(range(at - gamma - 1, at))
        return logits[torch.tensor(keep, device=logits.device)], out

    @staticmethod
    def _shaped(jobs: list[VerifyJob], items: list[ForwardItem], logits: torch.Tensor) -> torch.Tensor:
        """The packed rows the verdicts read: `logits` itself where no job shapes its logits,
        else a copy whose shaping jobs' rows are shaped by each row's own position and prefix
        (specdec/shaping.py: the committed tokens, then the draft tokens before it)."""
        marked = [b for b, j in enumerate(jobs) if shapes(j.params)]
        if not marked:
            return logits
        out = logits.float().clone()
        ends = list(accumulate(len(j.draft_tokens) + 1 for j in jobs))
        for b in marked:
            job, rows = jobs[b], len(jobs[b].draft_tokens) + 1
            first = job.ref.start + len(job.ref.tokens)  # the position the first row predicts
            shaping.shape_(out[ends[b] - rows:ends[b]], items[b].cache.ids, first, job.params)
        return out

    @staticmethod
    def _logprobs(jobs: list[VerifyJob], logits: torch.Tensor, laws: torch.Tensor, verdicts: list[tuple]
                  ) -> list[tuple]:
        """The kept tokens' log-probabilities for the jobs that asked (specdec/logprobs.py),
        in one operator over their kept rows of the packed logits → per job (log-probabilities,
        top ids, top log-probabilities), or (None, None, None). Raw ones from `logits`,
        processed ones from the rows the verdicts read (`laws`: penalties applied)."""
        out: list[tuple] = [(None, None, None)] * len(jobs)
        asking = [b for b, j in enumerate(jobs) if j.logprobs]
        if not asking:
            return out
        starts = [end - len(j.draft_tokens) - 1 for end, j in zip(accumulate(len(j.draft_tokens) + 1 for j in jobs),
                                                                   jobs)]
        top = max(jobs[b].top_logprobs for b in asking)
        rows, tokens, counts = [], [], []
        for b in asking:
            n, token = verdicts[b][0], verdicts[b][1]
            rows.extend(range(starts[b], starts[b] + n + 1))
            tokens.extend(jobs[b].draft_tokens[:n] + [token])
            counts.append(n + 1)
        index = torch.tensor(rows, device=logits.device)
        picked = logits[index].float()  # a copy: rows of it may be replaced
        chosen_laws = [(at, jobs[b].params) for b, count, at0 in zip(asking, counts, accumulate([0] + counts))
                       if jobs[b].processed for at in range(at0, at0 + count)]
        if chosen_laws:  # the processed ones: their sampled laws' log-probabilities stand for their logits
            at = torch.tensor([i for i, _ in chosen_laws], device=logits.device)
            picked[at] = lp.processed_rows(laws[index[at]].float(), [law for _, law in chosen_laws])
        chosen, ids, values = lp.token_logprobs(picked, torch.tensor(tokens), top)
        at = 0
        for b, count in zip(asking, counts):
            k = jobs[b].top_logprobs
            out[b] = (chosen[at:at + count].tolist(), ids[at:at + count, :k].flatten().tolist(),
                      values[at:at + count, :k].flatten().tolist())
            at += count
        return out

    def _decide(self, jobs: list[VerifyJob], logits: torch.Tensor) -> list[tuple[int, int, list[float] | None]]:
        """Acceptance for the batch: greedy sessions by argmax, the others by the full rule.
        logits: the packed [Σ (γ_b + 1), V] rows of all jobs, in job order → per job (kept
        length, next token, keep chances or None)."""
        out: list[tuple[int, int, list[float] | None] | None] = [None] * len(jobs)
        ends = list(accumulate(len(j.draft_tokens) + 1 for j in jobs))
        spans = [range(e - len(j.draft_tokens) - 1, e) for e, j in zip(ends, jobs)]
        greedy = [b for b, j in enumerate(jobs) if j.params.greedy]
        sampled = [b for b, j in enumerate(jobs) if not j.params.greedy]
        for group, decide in ((greedy, self._decide_greedy), (sampled, self._decide_sampled)):
            if group:
                rows = logits if len(group) == len(jobs) else logits[[r for b in group for r in spans[b]]]
                for b, verdict in zip(group, decide([jobs[b] for b in group], rows)):
                    out[b] = verdict
        return out  # type: ignore[return-value]

    def _decide_greedy(self, jobs: list[VerifyJob], logits: torch.Tensor) -> list[tuple[int, int, None]]:
        """No distributions needed (sampling.verify_greedy): compare the draft with the argmaxes."""
        verdicts = sampling.greedy_verdicts([j.draft_tokens for j in jobs], sampling.argmax_rows(logits).tolist())
        return [(n, token, None) for n, token in verdicts]

    def _decide_sampled(self, jobs: list[VerifyJob], logits: torch.Tensor) -> list[tuple[int, int, list[float]]]:
        """The full rule for a batch, on the packed rows: the target's laws in one set of
        operators per sampling law (sampling.probs_rows), then only what the rule reads —
        p and q at the draft tokens for acceptance, one row of each at every session's
        stopping position for recovery or bonus. Padded [B, γ + 1, V] float64 tensors of
        p and q (what `sampling.verify` takes) cost 7 ms of a 40 ms batch of 16 sessions
        at γ = 4 here; these gathers, a fraction of that. The values are the same, so are
        the verdicts (tests/target_service/test_engine.py)."""
        gammas = [len(j.draft_tokens) for j in jobs]
        starts = [end - g - 1 for end, g in zip(accumulate(g + 1 for g in gammas), gammas)]
        firsts = [j.ref.start + len(j.ref.tokens) for j in jobs]  # position of each first draft token
        params = [j.params for j in jobs for _ in range(len(j.draft_tokens) + 1)]
        probs = sampling.probs_rows(logits, params)  # [Σ (γ + 1), V] float32
        kernels = native.loaded()
        if (kernels is not None and self.native_verdicts and self.rule == "block" and probs.is_cpu
                and all(isinstance(j.q, torch.Tensor) and j.q.is_cpu and j.q.dtype == torch.float64
                        for j, g in zip(jobs, gammas) if g)):
            return self._decide_block_natively(kernels, jobs, probs, gammas, starts, firsts)
        accepted, weights, chances = self._acceptance(jobs, probs, gammas, starts, firsts)
        stops = accepted.tolist()
        return list(zip(stops, self._next_tokens(jobs, probs, gammas, starts, firsts, stops, weights), chances))

    def _acceptance(self, jobs: list[VerifyJob], probs: torch.Tensor, gammas: list[int], starts: list[int],
                    firsts: list[int]) -> tuple[torch.Tensor, list | None, list[list[float]]]:
        """The acceptance half on the packed rows: p and q at the draft tokens only, [B, γ]
        → (kept lengths [B], the block rule's weights per session or None, each session's
        keep chances for the γ policy)."""
        B, G, device = len(jobs), max(gammas), probs.device
        if G == 0:
            return torch.zeros(B, dtype=torch.long), None, [[] for _ in jobs]
        slots = [(b, i) for b, g in enumerate(gammas) for i in range(g)]
        batch_of = torch.tensor([b for b, _ in slots])
        step = torch.tensor([i for _, i in slots])
        tokens = torch.tensor([t for j in jobs for t in j.draft_tokens])
        p_x = torch.zeros(B, G, dtype=torch.float64)
        q_x = torch.zeros(B, G, dtype=torch.float64)
        p_x[batch_of, step] = probs[torch.tensor([starts[b] + i for b, i in slots], device=device),
                                    tokens.to(device)].double().cpu()
        q_x[batch_of, step] = torch.cat([law_at(j.q, j.draft_tokens) for j, g in zip(jobs, gammas) if g])
        u_acc = torch.zeros(B, G, dtype=torch.float64)
        u_acc[batch_of, step] = sampling.uniforms_at([jobs[b].params.seed for b, _ in slots],
                                                     [firsts[b] + i for b, i in slots], sampling.STREAM_ACCEPT)
        if self.rule == "block":
            accepted, weights = self._block_stops(jobs, gammas, probs, starts, p_x, q_x, u_acc)
            return accepted, weights, [w[1:] for w in weights]
        accepted = sampling.accepted_lengths(p_x, q_x, u_acc, torch.tensor(gammas))
        px, qx = p_x.tolist(), q_x.tolist()
        return accepted, None, [sampling.token_keep_chances_row(px[b][:g], qx[b][:g]) for b, g in enumerate(gammas)]

    @staticmethod
    def _next_tokens(jobs: list[VerifyJob], probs: torch.Tensor, gammas: list[int], starts: list[int],
                     firsts: list[int], stops: list[int], weights: list | None) -> list[int]:
        """The recovery half: each session's token at its stopping position. A bonus after a
        fully accepted draft is drawn by the exponential race (sampling.verify's bonus_noise),
        which the draft's guess of it shares; the others by inverse CDF from the residual
        (under the block rule, of p scaled by the kept prefix's weight)."""
        B, V, device = len(jobs), probs.shape[-1], probs.device
        p_n = probs[torch.tensor([s + n for s, n in zip(starts, stops)], device=device)].double()  # [B, V]
        full, rest = [], []
        for b, (g, n) in enumerate(zip(gammas, stops)):
            (full if g > 0 and n >= g else rest).append(b)
        next_token = [0] * B

        def draw(group: list[int], tokens_of) -> None:
            rows = p_n if len(group) == B else p_n[torch.tensor(group, device=device)]
            for b, token in zip(group, tokens_of(rows).tolist()):
                next_token[b] = token

        if rest:
            # each session's draft row at its stopping position (none after a whole draft kept)
            q_n = law_rows([(jobs[b].q, stops[b]) if stops[b] < gammas[b] else None for b in rest], V, device)
            u_n = sampling.uniforms_at([jobs[b].params.seed for b in rest], [firsts[b] + stops[b] for b in rest],
                                       sampling.STREAM_RESAMPLE)
            w_n = None
            if weights is not None:  # the kept prefix's weight scales p (a bonus: 1)
                w_n = torch.tensor([weights[b][stops[b]] if stops[b] < gammas[b] else 1.0 for b in rest],
                                   dtype=torch.float64)
            draw(rest, lambda rows: sampling.next_tokens(rows, q_n, u_n, w_n))
        if full:
            noise = sampling.bonus_noise([jobs[b].params.seed for b in full], [firsts[b] + stops[b] for b in full], V)
            draw(full, lambda rows: sampling.race_argmax(rows, noise))
        return next_token

    @staticmethod
    def _decide_block_natively(kernels, jobs: list[VerifyJob], probs: torch.Tensor, gammas: list[int],
                               starts: list[int], firsts: list[int]) -> list[tuple[int, int, list[float]]]:
        """The block rule in one call of specdec.native's block_verdicts: the verdicts of the
        operators below to the bit (tests/target_service/test_engine.py), for a tenth of
        their cost at one session. Only a bonus after a fully kept draft is drawn here, by
        the exponential race with the noise the draft's guess of it shares."""
        none = torch.empty(0, 0, dtype=torch.float64)
        kept, tokens, weights = kernels.block_verdicts(
            probs, starts, gammas, [t for j in jobs for t in j.draft_tokens],
            [j.q if g else none for j, g in zip(jobs, gammas)], [j.params.seed & sampling.MASK64 for j in jobs],
            firsts)
        full = [b for b, token in enumerate(tokens) if token < 0]
        if full:
            rows = probs[torch.tensor([starts[b] + gammas[b] for b in full])]
            noise = sampling.bonus_noise([jobs[b].params.seed for b in full], [firsts[b] + gammas[b] for b in full],
                                         probs.shape[-1])
            for b, token in zip(full, sampling.race_argmax(rows, noise).tolist()):
                tokens[b] = token
        return [(n, token, w[1:]) for n, token, w in zip(kept, tokens, weights)]

    @staticmethod
    def _block_stops(jobs: list[VerifyJob], gammas: list[int], probs: torch.Tensor, starts: list[int],
                     p_x: torch.Tensor, q_x: torch.Tensor, eta: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """The block rule for a batch (sampling.block_accepted, whose verdicts these are
        exactly): weights and stop tests in plain Python per session, and one operator over
        the rows whose residual mass a test needs — none for a session whose whole draft is
        kept, which is tested first. → ([B] kept prefix lengths, each session's weights w_0..w_γ)."""
        px, qx, us = p_x.tolist(), q_x.tolist(), eta.tolist()
        weights = [sampling.block_weights_row(px[b][:g], qx[b][:g]) for b, g in enumerate(gammas)]
        inner = [(b, i) for b, g in enumerate(gammas) if g > 1 and not sampling.block_keeps_all(weights[b], us[b][:g])
                 for i in range(1, g)]
        masses: dict[tuple[int, int], float] = {}
        if inner:
            rows = probs[torch.tensor([starts[b] + i for b, i in inner], device=probs.device)]
            q_rows = law_rows([(jobs[b].q, i) for b, i in inner], probs.shape[-1], probs.device)
            w = torch.tensor([weights[b][i] for b, i in inner], dtype=torch.float64)
            masses = dict(zip(inner, sampling.residual_mass(w, rows, q_rows).tolist()))
        stops = [sampling.block_prefix_row(weights[b], [masses.get((b, i), 0.0) for i in range(1, g)], us[b][:g])
                 for b, g in enumerate(gammas)]
        return torch.tensor(stops, dtype=torch.long), weights

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)
