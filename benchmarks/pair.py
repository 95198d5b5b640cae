"""The pair's performance script of issue 2: `python -m benchmarks.pair`.

On held-out prompts, in one process and one run: α of the draft against the target
(greedy and temperature 1, γ fixed, default 4), the draft/target cost ratio c, and
tokens/s of (a) HF generate() with the target alone, (b) HF assisted generation with the
draft, (c) our in-process speculative loop, side by side; the issue's target is (c) ≥ (b).
`run_pair()` returns the numbers as a dict for the model card (models/README.md).

Definitions are those of `python -m benchmarks.bench` (benchmarks/runs.py, costs.py,
inprocess.py): α = accepted ÷ tried, tried = Σ min(n + 1, γ) over rounds; c = draft step ÷
target step (ModelRunner, batch 1, one token over a 64-token cache, median); tokens/s =
tokens ÷ wall time, requests one after another; all with --threads torch threads.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.costs import expected_tokens, measure_costs
from benchmarks.inprocess import build_engines, quiet_transformers, run_hf, run_spec_loop
from benchmarks.runs import MODE_TITLES, MODES, make_requests
from specdec.model_runner import ModelRunner
from specdec.quantize import CHOICES as QUANTIZE_CHOICES, resolve as resolve_quantize
from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_model, load_tokenizer, pick_device, pick_dtype


def run_pair(draft_path: str = str(BUNDLED_DRAFT), target_path: str = str(BUNDLED_TARGET), prompts: int = 8,
             max_new_tokens: int = 64, gamma: int = 4, modes: tuple[str, ...] = ("greedy", "t1"),
             cost_reps: int = 10, device: str = "auto", draft_quantize: str = "auto") -> dict:
    """α, c and the three systems' tokens/s; see the module docstring."""
    dev = pick_device(device)
    dtype = pick_dtype("auto", dev)
    tok = load_tokenizer(target_path)
    draft_model, target_model = load_model(draft_path, dev, dtype), load_model(target_path, dev, dtype)
    draft_quantize = resolve_quantize(draft_quantize, dev, dtype)  # as a draft replica resolves it
    from training.corpus import heldout_prompts

    requests = make_requests([tok(p)["input_ids"] for p in heldout_prompts(prompts)], prompts)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    costs = measure_costs(ModelRunner(draft_model, quantize=draft_quantize), ModelRunner(target_model), [1],
                          [0, gamma], reps=cost_reps)
    draft, target = build_engines(draft_model, target_model, draft_quantize)
    out = {"draft": draft_path, "draft_quantize": draft_quantize, "target": target_path, "prompts": prompts, "max_new_tokens": max_new_tokens,
           "gamma": gamma, "draft_step_ms": costs.draft_ms(1), "target_step_ms": costs.target_step_ms(1),
           "verify_ms": costs.verify(gamma, 1), "cost_ratio": costs.ratio, "modes": {}}
    for mode in modes:
        a = run_hf(target_model, requests, mode, 1, max_new_tokens, eos, pad)
        b = run_hf(target_model, requests, mode, 1, max_new_tokens, eos, pad, assistant=draft_model, gamma=gamma)
        c = run_spec_loop(draft, target, requests, mode, max_new_tokens, eos, gamma)
        out["modes"][mode] = {
            "alpha": c.alpha, "acceptance_rate": c.acceptance_rate, "tokens_per_target_pass": c.tokens_per_pass,
            "expected_tokens_per_pass": expected_tokens(c.alpha, gamma) if c.alpha is not None else None,
            "speedup_bound": costs.speedup_bound(c.alpha, gamma, 1) if c.alpha is not None else None,
            "tokens_per_s": {"hf_generate": a.tps, "hf_assisted": b.tps, "spec_loop": c.tps}}
    return out


def format_table(res: dict) -> str:
    quantized = f" ({res['draft_quantize']} weights)" if res.get("draft_quantize", "none") != "none" else ""
    lines = [f"draft {res['draft']}{quantized}, target {res['target']}; {res['prompts']} held-out prompts × "
             f"{res['max_new_tokens']} new tokens, γ = {res['gamma']}",
             f"draft step {res['draft_step_ms']:.2f} ms, target step {res['target_step_ms']:.2f} ms, "
             f"cost ratio c = {res['cost_ratio']:.3f}; verify γ+1 = {res['gamma'] + 1} tokens "
             f"{res['verify_ms']:.2f} ms ({res['verify_ms'] / res['target_step_ms']:.2f} target steps)", "",
             "| mode | α | acc. rate | tokens/target pass | E[n] | speedup bound | HF generate tok/s "
             "| HF assisted tok/s | ours tok/s | ours ÷ HF assisted | ours ÷ HF generate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in res["modes"].items():
        t = m["tokens_per_s"]
        lines.append(f"| {MODE_TITLES[mode]} | {m['alpha']:.3f} | {m['acceptance_rate']:.3f} | "
                     f"{m['tokens_per_target_pass']:.2f} | {m['expected_tokens_per_pass']:.2f} | "
                     f"{m['speedup_bound']:.2f} | {t['hf_generate']:.1f} | {t['hf_assisted']:.1f} | "
                     f"{t['spec_loop']:.1f} | {t['spec_loop'] / t['hf_assisted']:.2f} | "
                     f"{t['spec_loop'] / t['hf_generate']:.2f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per round (default 4)")
    ap.add_argument("--modes", default="greedy,t1", help="greedy and/or t1 (default both)")
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: the bundled draft)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: the bundled target)")
    ap.add_argument("--device", default="auto", help="auto|cpu|cuda")
    ap.add_argument("--draft-quantize", choices=QUANTIZE_CHOICES, default="auto",
                    help="the draft's weights in every system, as a draft replica's --quantize (auto: w8a8 or int8 for a "
                         "float32 draft on a CPU with the native kernels, else none; default auto)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--cost-reps", type=int, default=10, help="repetitions per timed forward (default 10)")
    ap.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if any(m not in MODES for m in modes):
        raise SystemExit(f"modes must be among {', '.join(MODES)}")
    quiet_transformers()
    torch.set_num_threads(args.threads)
    res = run_pair(args.draft, args.target, args.prompts, args.max_new_tokens, args.gamma, modes, args.cost_reps,
                   args.device, args.draft_quantize)
    res["command"] = "python -m benchmarks.pair " + " ".join(argv if argv is not None else sys.argv[1:])
    print(format_table(res))
    print(f"\n(command: {res['command']}; torch threads {args.threads})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
