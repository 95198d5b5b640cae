"""DraftEngine: γ autoregressive draft steps for a batch of sessions.

Knows nothing of gRPC. Each step is one packed forward over every session still
drafting; the distributions are quantised to their wire form before sampling, so the
tokens are drawn from exactly what the target will receive. Greedy sessions send no
distributions: the greedy rule needs only the tokens (sampling.verify_greedy), and a
batch of greedy sessions only takes the argmax of each step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec import sampling, shaping
from specdec.errors import CacheMismatch, InvalidRequest, SpecDecError
from specdec.model_runner import ForwardItem, ModelRunner
from specdec.sampling_params import shapes
from specdec.sessions import CacheRef, SessionTable
from specdec.wire import quantize

MAX_GAMMA = 16


@dataclass
class ProposeJob:
    ref: CacheRef
    gamma: int
    params: sampling.SamplingParams
    guess_bonus: bool = False  # a pre-draft: its first token guesses the target's bonus (sampling.bonus_guess_rows)
    stop_below: float = 0.0  # end early after a step whose top probability is below this (`_goes_on`)
    runner_ups: bool = False  # also return each step's runner-up token (greedy: what a branch forks from)
    fork: bool = False  # draft in a private copy of the session's cache (SessionTable.fork)

    @property
    def forward_size(self) -> int:
        """The size of this job's share of the forwards: pending tokens plus γ steps."""
        return len(self.ref.tokens) + self.gamma


@dataclass
class Proposal:
    tokens: list[int]  # [γ]
    q: torch.Tensor | None  # [γ, V] float32 quantised (fp16-exact) distributions; None when greedy
    cache_length: int
    compute_ms: float = 0.0
    batch_size: int = 1
    runner_ups: list[int] | None = None  # [γ] with ProposeJob.runner_ups


class DraftEngine:
    def __init__(self, runner: ModelRunner, max_sessions: int = 256, max_cache_bytes: int = 0) -> None:
        self.runner = runner
        self.sessions = SessionTable(runner, max_sessions, max_cache_bytes)
        self.forward_passes = 0
        self.fed_tokens = 0
        # plain proposals' steps in one native call where the runner can (`_draft_natively`);
        # off, every proposal runs the step loop (a probe that watches each step's logits)
        self.native_drafts = True

    def propose(self, jobs: list[ProposeJob]) -> list[Proposal | SpecDecError]:
        """One batch of proposals; a bad job gets its error back and the rest go on."""
        t0 = time.perf_counter()
        results, live, caches = self._admit(jobs)
        # a new session's cache may hold a copied prefix of its tokens already (SessionTable.acquire)
        feed = {i: torch.tensor(jobs[i].ref.tokens[caches[i].length - jobs[i].ref.start:], dtype=torch.long)
                for i in live}
        drafts = self._draft_natively([jobs[i] for i in live], [ForwardItem(caches[i], feed[i], 1) for i in live])
        if drafts is None:
            return self._draft_stepwise(jobs, live, caches, feed, results, t0)
        self.forward_passes += max(jobs[i].gamma for i in live)
        self.fed_tokens += sum(len(feed[i]) + jobs[i].gamma - 1 for i in live)
        ms = (time.perf_counter() - t0) * 1000
        for i, (tokens, q) in zip(live, zip(*drafts)):
            ref = jobs[i].ref  # the steps fed the drafted tokens but the last
            caches[i].write_ids(ref.start, ref.tokens + tokens[:caches[i].length - ref.start - len(ref.tokens)])
            results[i] = Proposal(tokens=tokens, q=q, cache_length=caches[i].length, compute_ms=ms,
                                  batch_size=len(live))
        return results  # type: ignore[return-value]

    def _admit(self, jobs: list[ProposeJob]) -> tuple[list, list[int], dict]:
        """Validate every job and take its cache: → (results with each refused job's error in
        its place, the indices of the jobs that go on, their caches by index). Forks copy
        before any job of the batch writes, so all caches are taken before any forward; then
        room is made for the batch's growth at once."""
        results: list[Proposal | SpecDecError | None] = [None] * len(jobs)
        busy = {j.ref.session_id for j in jobs}
        last = {j.ref.session_id: i for i, j in enumerate(jobs) if not j.fork}
        live: list[int] = []
        caches = {}
        for i, job in enumerate(jobs):
            try:
                if not job.fork and last[job.ref.session_id] != i:  # a pre-draft the orchestrator gave up on
                    raise CacheMismatch(f"session {job.ref.session_id}: superseded by a newer proposal")
                if not 1 <= job.gamma <= MAX_GAMMA:
                    raise InvalidRequest(f"num_tokens (γ) must lie in 1..{MAX_GAMMA}, got {job.gamma}")
                if not job.ref.tokens:
                    raise InvalidRequest("a proposal needs at least one new committed token to feed")
                if job.runner_ups and not job.params.greedy:
                    raise InvalidRequest("runner_ups are for greedy proposals only")
                shaping.check(job.params, self.runner.vocab_size)
                self.sessions.validate(job.ref, extra=job.gamma)
                caches[i] = (self.sessions.fork(job.ref, job.gamma) if job.fork
                             else self.sessions.acquire(job.ref, exact=False, busy=busy)[0])
                live.append(i)
            except SpecDecError as exc:
                # a refusal travels as a value: without its traceback, which would hold this
                # frame (the batch's logits and caches) in a cycle until the cyclic GC ran
                results[i] = exc.with_traceback(None)
        self.sessions.make_room([(caches[i], jobs[i].ref.start + jobs[i].forward_size) for i in live
                                 if not jobs[i].fork], busy)
        return results, live, caches

    def _draft_stepwise(self, jobs: list[ProposeJob], live: list[int], caches: dict, feed: dict,
                        results: list, t0: float) -> list[Proposal | SpecDecError]:
        """The step loop, for what one native call cannot draft (a bonus guess, runner-ups, an
        early stop, mixed laws, or no native forward): one packed forward a step over the
        jobs still drafting, each step's draw for the whole batch at once."""
        drafted = {i: ([], []) for i in live}
        seconds = {i: [] for i in live if jobs[i].runner_ups}
        step = 0
        while live:
            items = [ForwardItem(caches[i], feed[i], 1) for i in live]
            for i in live:  # the ids a later penalised request counts, whatever this one samples with
                caches[i].write_ids(caches[i].length, feed[i].tolist())
            logits = self.runner.forward_packed(items)  # [live, V]
            self.forward_passes += 1
            self.fed_tokens += sum(len(it.tokens) for it in items)
            logits = self._shaped([jobs[i] for i in live], [caches[i] for i in live], logits)
            # the whole batch's step at once: one set of operators per sampling law, not per session
            params = [jobs[i].params for i in live]
            if all(p.greedy for p in params):
                q16, tokens = None, sampling.argmax_rows(logits).cpu()
            else:
                q16 = quantize(sampling.probs_rows(logits, params))  # [live, V]
                # a pre-draft's first token guesses the target's bonus (sampling.bonus_guess_rows)
                guesses = [row for row, i in enumerate(live) if jobs[i].guess_bonus] if step == 0 else []
                tokens = sampling.draft_tokens_rows(q16, params, [caches[i].length for i in live], guesses).cpu()
            top = (sampling.top_probability(logits).tolist() if any(jobs[i].stop_below > 0 for i in live)
                   else None)
            second = (sampling.runner_up_rows(logits, tokens).tolist()
                      if any(jobs[i].runner_ups for i in live) else None)
            still = []
            for row, (i, token) in enumerate(zip(live, tokens.tolist())):
                drafted[i][0].append(token)
                if i in seconds:
                    seconds[i].append(second[row])
                if not jobs[i].params.greedy:
                    drafted[i][1].append(q16[row])
                if step + 1 < jobs[i].gamma and self._goes_on(jobs[i], step, None if top is None else top[row]):
                    feed[i] = tokens[row : row + 1]
                    still.append(i)
            live = still
            step += 1
        ms = (time.perf_counter() - t0) * 1000
        for i, (tokens, rows) in drafted.items():
            results[i] = Proposal(tokens=tokens, q=torch.stack(rows) if rows else None, cache_length=caches[i].length,
                                  compute_ms=ms, batch_size=len(drafted), runner_ups=seconds.get(i))
        return results  # type: ignore[return-value]

    @staticmethod
    def _shaped(jobs: list[ProposeJob], caches: list, logits: torch.Tensor) -> torch.Tensor:
        """A step's logits, each shaping job's row shaped at its cache's position by its
        cache's tokens (specdec/shaping.py): the draft drafts from the law the target verifies
        against, so that a bias, a ban or a penalty does not turn into rejections."""
        marked = [row for row, j in enumerate(jobs) if shapes(j.params)]
        if not marked:
            return logits
        out = logits.float().clone()
        for row in marked:
            shaping.shape_(out[row:row + 1], caches[row].ids, caches[row].length, jobs[row].params)
        return out

    @staticmethod
    def _plain_greedy(jobs: list[ProposeJob]) -> bool:
        """Jobs whose steps need nothing but each row's argmax (greedy, no runner-ups, no
        early stop; shaped only where the kernels shape): the runner can draft them in one
        native call (ModelRunner.draft_greedy)."""
        return bool(jobs) and all(j.params.greedy and not j.runner_ups and j.stop_below <= 0
                                  and _natively_shaped(j.params) for j in jobs)

    @staticmethod
    def _plain_sampled(jobs: list[ProposeJob]) -> bool:
        """Jobs drawn under one law (temperature, top-k, top-p, min-p) with nothing but the
        draw at each step (no bonus guess, no early stop; shaped only where the kernels
        shape): the runner can draft them in one native call (ModelRunner.draft_sampled)."""
        return (bool(jobs) and len({sampling.law_key(j.params) for j in jobs}) == 1
                and all(not j.params.greedy and not j.guess_bonus and _natively_shaped(j.params)
                        and j.stop_below <= 0 for j in jobs))

    def _draft_natively(self, jobs: list[ProposeJob], items: list[ForwardItem]):
        """→ (tokens, q or None) per job from one native call of every step, where the jobs
        are plain greedy or plain sampled ones and the runner's forward is native; else None
        (the step loop drafts them). A sampled job's step s draws with its draft-stream
        uniform at position (its cache's length after that step's feed), as the loop does;
        a shaping job's steps are shaped in the call, as the loop's `_shaped` shapes them."""
        if not self.native_drafts:
            return None
        gammas = [j.gamma for j in jobs]
        shapings = [shaping.native_shaping(j.params) if shapes(j.params) else None for j in jobs]
        if self._plain_greedy(jobs):
            tokens = self.runner.draft_greedy(items, gammas, shapings)
            return None if tokens is None else (tokens, [None] * len(jobs))
        if not self._plain_sampled(jobs):
            return None
        G = max(gammas)
        firsts = [it.cache.length + len(it.tokens) for it in items]
        uniforms = sampling.uniforms_at([j.params.seed for j in jobs for _ in range(G)],
                                        [p + s for p in firsts for s in range(G)], sampling.STREAM_DRAFT)
        return self.runner.draft_sampled(items, gammas, jobs[0].params, uniforms.view(len(jobs), G), shapings)

    @staticmethod
    def _goes_on(job: ProposeJob, step: int, top: float | None) -> bool:
        """Whether a proposal drafts past this step: not when the draft was unsure of the
        token just drafted (its top probability below the job's `stop_below`), where the
        tokens after it would likely be rejected and their steps and verification wasted.
        Priced in process with `benchmarks.stop_rule_probe` on the bundled pair: greedy,
        stopping below 0.1 made 1.05–1.12× the best fixed γ; at temperature 1 no threshold
        beat it (there a low-probability draw is accepted as often as not). Through the
        services the greedy gain turned into a loss (more, shorter rounds), so the
        orchestrator asks for it only when configured to (`--stop-below-greedy`). A
        pre-draft's bonus guess (step 0) is never cut after: that would leave no draft."""
        if top is None or job.stop_below <= 0 or (job.guess_bonus and step == 0):
            return True
        return top >= job.stop_below

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)


def _natively_shaped(params) -> bool:
    """Whether a native draft can take the job's shaping: none, or the kernels' own."""
    return not shapes(params) or shaping.native_shaping(params) is not None
