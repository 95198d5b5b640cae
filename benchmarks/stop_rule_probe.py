"""Would a confidence stop beat a fixed γ? `python -m benchmarks.stop_rule_probe`.

A draft can end its proposal early where it is unsure: HF assisted generation stops when
the drafted token's probability falls below a threshold (`assistant_confidence_threshold`),
and SpecDec++ and similar work learn such a rule. Any rule that looks only at what the
draft has drafted keeps the output exactly the target's (each position is still accepted
with min(1, p/q) given the committed prefix), so the question is speed only.

This runs our in-process loop at γ = `--max-gamma` over held-out prompts and records, per
round, each drafted token's draft probability q(x_i), the draft's largest probability
max q_i at that step and how many tokens the target accepted. Acceptance at position i
depends only on the prefix, so the same rounds tell what any shorter proposal would have
given: a proposal cut after k tokens yields min(accepted, k) + 1 tokens. With the step
costs measured here (ModelRunner forwards at batch 1) plus `--overhead-ms` per round (the
distributed pipeline's two hops and orchestrator, about 3–4 ms on the 2-core CPU; 0 for
the in-process loop), it prints tokens/s for every fixed γ and for stopping after the
first token whose q(x) or max q is below each threshold.
"""
from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass

import torch

from benchmarks.costs import measure_costs
from benchmarks.runs import MODES
from draft_service.engine import DraftEngine
from specdec.model_runner import ModelRunner
from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_model, load_tokenizer
from specdec.sampling import SamplingParams
from specdec.spec_loop import generate
from target_service.engine import TargetEngine


@dataclass
class Round:
    q_token: list[float]  # q(x_i) of each drafted token
    q_top: list[float]  # max q_i at each draft step
    accepted: int


class RecordingDraft:
    """The draft engine, with each proposal's confidences kept (from the draft's own logits,
    so greedy proposals, which carry no distributions, have them too)."""

    def __init__(self, engine: DraftEngine, temperature: float) -> None:
        self.engine, self.runner, self.temperature = engine, engine.runner, temperature
        engine.native_drafts = False  # every step through forward_packed, where it is recorded
        self.steps: list[torch.Tensor] = []
        forward = engine.runner.forward_packed

        def recording(items):
            logits = forward(items)
            self.steps.append(logits[-1])
            return logits
        engine.runner.forward_packed = recording

    def propose(self, jobs):
        self.steps = []
        out = self.engine.propose(jobs)
        tokens = out[0].tokens
        # greedy drafts by argmax; its confidence is still the draft's law at temperature 1
        probs = torch.softmax(torch.stack(self.steps[-len(tokens):]).float() / (self.temperature or 1.0), -1)
        self.last = ([float(probs[i, t]) for i, t in enumerate(tokens)], probs.max(-1).values.tolist())
        return out

    def release(self, session_id: str) -> bool:
        return self.engine.release(session_id)


class RecordingTarget:
    def __init__(self, engine: TargetEngine, draft: RecordingDraft, rounds: list[Round]) -> None:
        self.engine, self.runner, self.draft, self.rounds = engine, engine.runner, draft, rounds

    def verify(self, jobs):
        out = self.engine.verify(jobs)
        if jobs[0].draft_tokens:
            self.rounds.append(Round(*self.draft.last, out[0].accepted))
        return out

    def release(self, session_id: str) -> bool:
        return self.engine.release(session_id)


def tokens_per_second(rounds: list[Round], cut, draft_ms: float, verify_ms, overhead_ms: float) -> tuple[float, float]:
    """(tokens/s, mean γ) if each round's proposal had been cut after cut(round) tokens."""
    tokens = cost = drafted = 0.0
    for r in rounds:
        k = cut(r)
        tokens += min(r.accepted, k) + 1
        cost += overhead_ms + k * draft_ms + verify_ms(k)
        drafted += k
    return 1000 * tokens / cost, drafted / len(rounds)


def first_below(values: list[float], threshold: float) -> int:
    """Tokens kept when the proposal stops after the first value below the threshold."""
    for i, v in enumerate(values):
        if v < threshold:
            return i + 1
    return len(values)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stop_rule_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--mode", choices=sorted(MODES), default="t1", help="sampling (default t1: temperature 1)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    ap.add_argument("--max-gamma", type=int, default=6, help="the longest proposal (default 6)")
    ap.add_argument("--thresholds", default="0.05,0.1,0.2,0.3,0.5", help="stop thresholds (default 0.05,0.1,0.2,0.3,0.5)")
    ap.add_argument("--overhead-ms", type=float, default=0.0,
                    help="fixed cost per round beside the forwards (default 0: the in-process loop)")
    ap.add_argument("--cost-reps", type=int, default=30, help="timed forwards per step cost (default 30)")
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: bundled)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: bundled)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        thresholds = [float(x) for x in args.thresholds.split(",")]
    except ValueError:
        raise SystemExit(f"--thresholds: expected numbers like 0.1,0.3, got {args.thresholds!r}") from None
    if min(args.max_gamma, args.prompts, args.max_new_tokens, args.cost_reps) < 1:
        raise SystemExit("--max-gamma, --prompts, --max-new-tokens and --cost-reps must be at least 1")
    from training.corpus import heldout_prompts

    torch.set_num_threads(1)
    device = torch.device("cpu")
    draft_runner = ModelRunner(load_model(args.draft, device, torch.float32))
    target_runner = ModelRunner(load_model(args.target, device, torch.float32))
    tok = load_tokenizer(args.target)
    base = MODES[args.mode]
    rounds: list[Round] = []
    draft = RecordingDraft(DraftEngine(draft_runner), base.temperature)
    target = RecordingTarget(TargetEngine(target_runner), draft, rounds)
    for i, prompt in enumerate(heldout_prompts(args.prompts)):
        params = SamplingParams(base.temperature, base.top_k, base.top_p, 1000 + i)
        generate(draft, target, tok(prompt)["input_ids"], params, args.max_gamma, args.max_new_tokens, None,
                 uuid.uuid4().hex)
    rounds = [r for r in rounds if len(r.q_token) == args.max_gamma]  # the last rounds of a prompt draft fewer
    costs = measure_costs(draft_runner, target_runner, [1], list(range(args.max_gamma + 1)), reps=args.cost_reps)
    step, verify = costs.draft_ms(1), lambda k: costs.verify(k, 1)
    print(f"{len(rounds)} rounds of γ = {args.max_gamma} ({args.mode}); draft step {step:.2f} ms, target step "
          f"{costs.target_step_ms(1):.2f} ms, overhead {args.overhead_ms:.1f} ms a round")
    print("verify ms by γ: " + ", ".join(f"{g} {verify(g):.2f}" for g in range(args.max_gamma + 1)))
    fixed = {g: tokens_per_second(rounds, lambda r, g=g: g, step, verify, args.overhead_ms)
             for g in range(1, args.max_gamma + 1)}
    best = max(tps for tps, _ in fixed.values())
    for g, (tps, _) in fixed.items():
        print(f"fixed γ = {g}: {tps:.1f} tokens/s ({tps / best:.3f} × the best fixed γ)")
    for name, values in (("q(x)", lambda r: r.q_token), ("max q", lambda r: r.q_top)):
        for th in thresholds:
            tps, mean = tokens_per_second(rounds, lambda r: first_below(values(r), th), step, verify, args.overhead_ms)
            print(f"stop after {name} < {th:g}: {tps:.1f} tokens/s, mean γ {mean:.2f} ({tps / best:.3f} × the best fixed γ)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
