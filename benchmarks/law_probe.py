"""What a request's sampling law costs a round: `python -m benchmarks.law_probe`.

Times, in one process on the bundled pair's engines, rounds of speculation (a draft
proposal of γ tokens, then the target's verification of it, the session going on with what
was kept) under several laws: plain temperature 1, top-p, top-k, min-p, a repetition
penalty, and all of those with a logit bias. Each law runs in two arms by turns: `native`,
as the services run (the law by specdec.native's law_rows, top-p's mask in it by its
top_p_drop, shaping by its shape_rows, and every step of such a proposal in one native
call), and `operators`, as they ran before those (the law by torch's operators, the mask by
a sort, shaping by torch and numpy operators, and a proposal that cuts or shapes its law
drafted by the Python step loop). Both arms draw the
same tokens (the kernels are their operators' to the bit), so they time the same work; the
table gives each arm's median proposal and verification over the rounds.

With `--alone`, the law by itself instead: temperature, top-k, top-p and min-p over rows of
the bundled target's own logits (1, 5 and 80 rows: a draft step, a verification at γ = 4,
and one of 16 sessions), by torch's operators (top-p's mask by the kernel, as the engines ran
before specdec.native's law_rows) and by law_rows, by turns.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import native, rounds, sampling, shaping
from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_model, load_tokenizer
from specdec.sampling import SamplingParams

LAWS = {
    "t = 1": {},
    "top-p 0.95": {"top_p": 0.95},
    "top-k 50": {"top_k": 50},
    "min-p 0.05": {"min_p": 0.05},
    "repetition 1.2": {"repetition_penalty": 1.2},
    "all of them, a bias": {"top_p": 0.95, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.2,
                            "presence_penalty": 0.5, "logit_bias": ((13, 1.0),)},
}


ALONE_LAWS = {  # temperature 0.8 in the last: law_rows divides as the operators do
    "t = 1": {}, "top-p 0.95": {"top_p": 0.95}, "top-k 50": {"top_k": 50}, "min-p 0.05": {"min_p": 0.05},
    "all four, t = 0.8": {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.05},
}


class Arms:
    """Switches sampling, shaping and the draft engine between the kernels and the operators."""

    def __init__(self, draft) -> None:
        if native.module() is None:
            raise SystemExit(f"specdec's CPU kernels are unavailable here: {native.unavailable_reason()}")
        self.draft = draft
        self.top_p_drop, self.native_shaping = sampling.top_p_drop, shaping.native_shaping
        self.logits_to_probs = sampling.logits_to_probs

    def by_operators(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return self.logits_to_probs(logits, params) if params.greedy else sampling.logits_to_probs_torch(logits, params)

    def use(self, kernels: bool) -> None:
        sampling.logits_to_probs = self.logits_to_probs if kernels else self.by_operators
        sampling.top_p_drop = self.top_p_drop if kernels else sampling.top_p_drop_torch
        shaping.native_shaping = self.native_shaping if kernels else (lambda params: None)
        plain = type(self.draft)._plain_sampled
        self.draft._plain_sampled = plain if kernels else (lambda jobs: plain(jobs) and all(
            j.params.top_k <= 0 and j.params.top_p >= 1.0 and j.params.min_p <= 0.0 for j in jobs))


def time_rounds(draft, target, prompt: list[int], law: SamplingParams, sid: str, steps: int, gamma: int
                ) -> tuple[float, float, list[int]]:
    """Median ms of a proposal and of a verification over `steps` rounds of a new session,
    and the tokens those rounds committed (each cache fed as specdec.rounds' cursor says)."""
    from draft_service.engine import ProposeJob
    from target_service.engine import VerifyJob

    context, cur = list(prompt), rounds.Cursor()
    proposals, verifications = [], []
    for step in range(steps + 1):  # the first round prefills both caches: not timed
        m = len(context)
        t0 = time.perf_counter()
        proposal = draft.propose([ProposeJob(rounds.draft_ref(sid, 1, context, cur), gamma, law)])[0]
        t1 = time.perf_counter()
        verdict = target.verify([VerifyJob(rounds.target_ref(sid, 1, context, cur), proposal.tokens,
                                           None if proposal.q is None else proposal.q.double(), law)])[0]
        t2 = time.perf_counter()
        if isinstance(verdict, Exception) or isinstance(proposal, Exception):
            raise SystemExit(f"law_probe: {verdict if isinstance(verdict, Exception) else proposal}")
        if step:
            proposals.append(t1 - t0)
            verifications.append(t2 - t1)
        new = rounds.new_tokens(proposal.tokens, verdict.accepted, verdict.next_token)
        context += new
        cur = rounds.advance(cur, m, gamma, verdict.accepted, verdict.cache_length, len(new))
    draft.release(sid)
    target.release(sid)
    return statistics.median(proposals) * 1e3, statistics.median(verifications) * 1e3, context[len(prompt):]


def time_laws_alone(logits: torch.Tensor, row_counts: list[int], turns: int) -> None:
    """Median µs of each law over `row_counts` rows of `logits`, operators then law_rows,
    by turns; both give the same bits (tests/specdec/test_native_sampling.py)."""
    arms = {"operators": sampling.logits_to_probs_torch, "law_rows": sampling.logits_to_probs}
    print("| law | rows | operators µs | law_rows µs |")
    print("|---|---|---|---|")
    for rows in row_counts:
        block = logits[torch.arange(rows) % logits.shape[0]].contiguous()
        for name, fields in ALONE_LAWS.items():
            law, times = SamplingParams(**{"temperature": 1.0, **fields}), {arm: [] for arm in arms}
            for turn in range(turns):
                for arm in (arms if turn % 2 == 0 else reversed(arms)):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        arms[arm](block, law)
                    times[arm].append((time.perf_counter() - t0) / 10 * 1e6)
            print(f"| {name} | {rows} | {statistics.median(times['operators']):.1f} | "
                  f"{statistics.median(times['law_rows']):.1f} |")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.law_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--rounds", type=int, default=6, help="turns of both arms per law (default 6)")
    ap.add_argument("--steps", type=int, default=40, help="timed speculation rounds per turn (default 40)")
    ap.add_argument("--gamma", type=int, default=4, help="tokens per proposal (default 4)")
    ap.add_argument("--alone", action="store_true",
                    help="time the law by itself over the target's own logits instead of rounds")
    ap.add_argument("--rows", default="1,5,80", help="with --alone: row counts, comma-separated (default 1,5,80)")
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: bundled)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: bundled)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.rounds, args.steps, args.gamma) < 1:
        raise SystemExit("--rounds, --steps and --gamma must be at least 1")
    from benchmarks.inprocess import build_engines
    from training.corpus import heldout_prompts

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    if args.alone:
        return alone(args)
    draft, target = build_engines(load_model(args.draft, cpu, torch.float32), load_model(args.target, cpu, torch.float32))
    prompt = load_tokenizer(args.target)(heldout_prompts(1)[0])["input_ids"]
    arms = Arms(draft)
    results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    texts: dict[tuple[str, int, bool], list[int]] = {}
    try:
        for rnd in range(args.rounds):
            for kernels in ((True, False) if rnd % 2 == 0 else (False, True)):
                arms.use(kernels)
                for name, fields in LAWS.items():
                    law = SamplingParams(1.0, seed=1000 + rnd, penalty_start=len(prompt), **fields)
                    *ms, texts[(name, rnd, kernels)] = time_rounds(draft, target, prompt, law, f"{name}-{rnd}-{kernels}",
                                                                   args.steps, args.gamma)
                    results.setdefault((name, kernels), []).append(tuple(ms))
    finally:
        arms.use(True)
    differ = sorted({name for name, rnd, _ in texts if texts[(name, rnd, True)] != texts[(name, rnd, False)]})
    if differ:  # the arms would not time the same work
        raise SystemExit(f"law_probe: the arms committed other tokens under {', '.join(differ)}")
    print(f"both arms committed the same tokens under every law, {len(texts) // 2} sessions of {args.steps} rounds")
    print(f"| law (γ = {args.gamma}), ms, median of rounds | proposal: operators | native | "
          "verification: operators | native |")
    print("|---|---|---|---|---|")
    for name in LAWS:
        off = [statistics.median(x) for x in zip(*results[(name, False)])]
        on = [statistics.median(x) for x in zip(*results[(name, True)])]
        print(f"| {name} | {off[0]:.2f} | {on[0]:.2f} | {off[1]:.2f} | {on[1]:.2f} |")
    return 0


def alone(args: argparse.Namespace) -> int:
    from training.corpus import heldout_prompts

    try:
        row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"--rows: comma-separated row counts, not {args.rows!r}") from None
    if not row_counts or min(row_counts) < 1:
        raise SystemExit("--rows: every row count must be at least 1")
    if native.module() is None:
        raise SystemExit(f"specdec's CPU kernels are unavailable here: {native.unavailable_reason()}")
    model = load_model(args.target, torch.device("cpu"), torch.float32)
    ids = load_tokenizer(args.target)(heldout_prompts(1)[0], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    time_laws_alone(logits, row_counts, 2 * args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
