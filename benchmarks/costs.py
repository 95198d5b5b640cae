"""What a model step costs, and the analytic bound it implies.

Costs are timed in-process on ModelRunner forwards (the runner the services use), over a
`context`-token KV cache per session: every shape below once per turn, two warm-up turns,
then the median of `reps` turns (`_time_by_turns`):

- draft step t_d(B):      the draft, B sessions × 1 new token, as the draft service drafts:
                          `decision_gamma` steps in one call of ModelRunner.draft_greedy (each
                          step's argmax fed back natively) after the target's forwards, their
                          mean; where the runner cannot draft natively (a GPU), as many forwards
                          in a row, each with its Python, as the engine's step loop takes them;
- target step t_t(B):     the target, B sessions × 1 new token (= verify with γ = 0);
- verify t_v(γ, B):       the target, B sessions × (γ + 1) new tokens, logits for all of them.
- decision(B):            the target's verdicts for B sessions at the bench's γ from the packed
                          logits (TargetEngine._decide), greedy and sampled at temperature 1;
- wire:                   encoding and decoding one session's dense [γ, V] draft distributions
                          (specdec.wire), as the draft and the target do at temperature 1.

After each timed forward the caches are truncated back to `context`, so every repetition
sees the same cache length. The cost ratio is c = t_d(1) / t_t(1).

The bound: with per-token acceptance α and γ draft tokens, a round yields on average
E[n] = (1 − α^(γ+1)) / (1 − α) tokens (Leviathan et al. 2023) and costs, with no overhead
and drafting and verifying one after the other, γ·t_d(B) + t_v(γ, B). So

    bound tokens/s        = 1000 · B · E[n] / (γ·t_d(B) + t_v(γ, B))
    speedup bound         = bound tokens/s / (1000 · B / t_t(B))
                          = E[n] / ((γ·t_d(B) + t_v(γ, B)) / t_t(B))

For γ = 0 the bound is plain decoding, 1000·B / t_t(B). A fractional γ (the adaptive
policy's mean) interpolates t_v linearly between the measured γ. A pipeline that
overlaps drafting with verification can exceed this bound (efficiency > 1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.model_runner import ForwardItem, ModelRunner


def expected_tokens(alpha: float, gamma: float) -> float:
    """E[n] = (1 − α^(γ+1)) / (1 − α): mean tokens per round (accepted + the one new token)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


@dataclass
class Costs:
    context: int
    draft_step_ms: dict[int, float] = field(default_factory=dict)  # batch → ms
    verify_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # batch → γ → ms
    decision_gamma: int = 0
    draft_run: int = 1  # draft steps timed in a row after the target's forwards (`_time_by_turns`)
    decision_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # batch → greedy/sampled → ms
    wire_ms: dict[str, float] = field(default_factory=dict)  # encode/decode → ms of one session's block

    def _batch(self, batch: int) -> int:
        """The measured batch size nearest to `batch`."""
        return min(self.verify_ms, key=lambda b: (abs(b - batch), b))

    def target_step_ms(self, batch: int = 1) -> float:
        return self.verify_ms[self._batch(batch)][0]

    def draft_ms(self, batch: int = 1) -> float:
        return self.draft_step_ms[self._batch(batch)]

    @property
    def ratio(self) -> float:
        """c = draft step / target step, batch 1."""
        return self.draft_ms(1) / self.target_step_ms(1)

    def verify(self, gamma: float, batch: int = 1) -> float:
        table = self.verify_ms[self._batch(batch)]
        gs = sorted(table)
        if gamma <= gs[0]:
            return table[gs[0]]
        for lo, hi in zip(gs, gs[1:]):
            if gamma <= hi:
                w = (gamma - lo) / (hi - lo)
                return (1 - w) * table[lo] + w * table[hi]
        lo, hi = gs[-2], gs[-1]  # extrapolate along the last segment
        return table[hi] + (gamma - hi) * (table[hi] - table[lo]) / (hi - lo)

    def round_ms(self, gamma: float, batch: int = 1) -> float:
        return gamma * self.draft_ms(batch) + self.verify(gamma, batch) if gamma > 0 else self.target_step_ms(batch)

    def bound_tps(self, alpha: float, gamma: float, batch: int = 1) -> float:
        e = expected_tokens(alpha, gamma) if gamma > 0 else 1.0
        return 1000.0 * batch * e / self.round_ms(gamma, batch)

    def speedup_bound(self, alpha: float, gamma: float, batch: int = 1) -> float:
        return self.bound_tps(alpha, gamma, batch) / self.bound_tps(0.0, 0, batch)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a timing ends when it does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Forward:
    """One timed shape: n_new tokens fed to every cache (each at `context`), cut back after.
    A `drafts` shape takes its steps as the draft service does (`run`)."""

    def __init__(self, runner: ModelRunner, caches, n_new: int, context: int, gen: torch.Generator,
                 drafts: bool = False) -> None:
        self.runner, self.caches, self.n_new, self.context, self.gen = runner, caches, n_new, context, gen
        self.drafts = drafts
        self.times: list[float] = []

    def run(self, keep: bool, times: int = 1) -> None:
        """`times` forwards in a row, kept (when `keep`) as their mean: a drafts shape's in one
        native call where the runner can (`_draft_natively`), else one call each."""
        if self.drafts and self._draft_natively(keep, times):
            return
        runner, n = self.runner, self.n_new
        total = 0.0
        for _ in range(times):
            items = [ForwardItem(c, torch.randint(runner.vocab_size, (n,), generator=self.gen), n)
                     for c in self.caches]
            sync_device(runner.device)
            t0 = time.perf_counter()
            runner.forward(items)
            sync_device(runner.device)
            total += time.perf_counter() - t0
            for c in self.caches:
                c.truncate(self.context)
        if keep:
            self.times.append(total * 1000 / times)

    def _draft_natively(self, keep: bool, steps: int) -> bool:
        """`steps` greedy draft steps of every cache in one ModelRunner.draft_greedy call, as
        DraftEngine drafts a plain proposal, so that the step is the draft service's: by turns
        (`measure_costs` at batch 1, three times each way, 2026-12-05 00:58 UTC) 0.078–0.082 ms
        a step so against 0.087–0.092 as forwards, each with the Python the engine skips
        there. False where the runner cannot draft natively."""
        runner = self.runner
        items = [ForwardItem(c, torch.randint(runner.vocab_size, (1,), generator=self.gen), 1) for c in self.caches]
        sync_device(runner.device)
        t0 = time.perf_counter()
        tokens = runner.draft_greedy(items, [steps] * len(items))
        sync_device(runner.device)
        elapsed = time.perf_counter() - t0
        if tokens is None:
            return False
        for c in self.caches:
            c.truncate(self.context)
        if keep:
            self.times.append(elapsed * 1000 / steps)
        return True

    @property
    def median(self) -> float:
        return sorted(self.times)[len(self.times) // 2]


def _time_by_turns(verifies: list[_Forward], drafts: list[_Forward], reps: int, draft_run: int) -> None:
    """Every shape once per turn, `reps` turns after two warm-up turns: a slow spell of a
    shared machine (they last seconds here) then weighs on every shape alike, where timing
    one shape after another let it land on one (a draft step read 0.55–1.02 ms from one
    run of measure_costs to the next, 2026-12-02, when each shape was timed in a block).
    The draft's steps come as a round drafts them, `draft_run` in a row after the target's
    forwards, and count as their mean: the first of them finds the draft's weights pushed
    out of the cache by the target's (1.3 ms against 0.6 for a warm step, on that day's
    AVX2 EPYC), the others warm."""
    for turn in range(reps + 2):
        for shape in verifies:
            shape.run(keep=turn >= 2)
        for shape in drafts:
            shape.run(keep=turn >= 2, times=draft_run)


def _prefilled(runner: ModelRunner, batch: int, context: int, gen: torch.Generator) -> list:
    caches = [runner.new_cache() for _ in range(batch)]
    runner.forward([ForwardItem(c, torch.randint(runner.vocab_size, (context,), generator=gen), 1) for c in caches])
    return caches


def _median_ms(fn, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def _decision_ms(target: ModelRunner, batch: int, gamma: int, reps: int, gen: torch.Generator) -> dict[str, float]:
    """TargetEngine._decide on random logits and draft distributions of a batch."""
    from specdec.sampling import SamplingParams
    from specdec.sessions import CacheRef
    from target_service.engine import TargetEngine, VerifyJob

    engine, V = TargetEngine(target), target.vocab_size
    logits = torch.randn(batch * (gamma + 1), V, generator=gen) * 2
    out = {}
    for name, params in (("greedy", SamplingParams(0.0)), ("sampled", SamplingParams(1.0, seed=1))):
        jobs = []
        for b in range(batch):
            q = torch.softmax(torch.randn(gamma, V, generator=gen, dtype=torch.float64) * 2, -1)
            tokens = torch.multinomial(q, 1, generator=gen).view(-1).tolist()
            jobs.append(VerifyJob(CacheRef(f"s{b}", 1, 100, [5]), tokens, None if params.greedy else q, params))
        out[name] = _median_ms(lambda: engine._decide(jobs, logits.to(target.device)), reps)
    return out


def _wire_ms(vocab: int, gamma: int, reps: int, gen: torch.Generator) -> dict[str, float]:
    from specdec.wire import decode, encode, quantize

    q16 = quantize(torch.softmax(torch.randn(gamma, vocab, generator=gen) * 2, -1))
    enc = encode(q16)
    return {"encode": _median_ms(lambda: encode(q16), reps), "decode": _median_ms(lambda: decode(enc, gamma), reps)}


@torch.inference_mode()
def measure_costs(draft: ModelRunner, target: ModelRunner, batches: list[int], gammas: list[int],
                  context: int = 64, reps: int = 10, seed: int = 0, decision_gamma: int = 4) -> Costs:
    """Draft step, target step and verify(γ) at each batch size, the target's decisions at
    `decision_gamma` and the wire's cost; see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    costs = Costs(context, decision_gamma=decision_gamma, draft_run=max(1, decision_gamma))
    draft_shapes, verify_shapes = {}, {}
    gammas = sorted(set(gammas) | {0})
    for b in sorted(set(batches)):
        draft_shapes[b] = _Forward(draft, _prefilled(draft, b, context, gen), 1, context, gen, drafts=True)
        caches = _prefilled(target, b, context, gen)
        verify_shapes[b] = {g: _Forward(target, caches, g + 1, context, gen) for g in gammas}
    _time_by_turns([shape for b in verify_shapes for shape in verify_shapes[b].values()],
                   list(draft_shapes.values()), reps, costs.draft_run)
    for b in draft_shapes:
        costs.draft_step_ms[b] = draft_shapes[b].median
        costs.verify_ms[b] = {g: shape.median for g, shape in verify_shapes[b].items()}
        costs.decision_ms[b] = _decision_ms(target, b, decision_gamma, reps, gen)
    costs.wire_ms = _wire_ms(target.vocab_size, decision_gamma, reps, gen)
    return costs
