"""What int8 weights cost a draft in acceptance: `python -m benchmarks.quant_probe`.

The teacher-forced held-out α at temperature 1 (the mean over positions of Σ min(p, q), the
chance a drafted token is accepted), the greedy agreement (the draft's argmax is the
target's) and the draft's loss, for the draft as it is, quantised to int8 and to w8a8
(specdec.quantize, what a draft replica's `--quantize int8` and `w8a8` serve; w8a8 emulated
in torch, every product's input rows rounded to int8 as the kernel rounds a decode step's),
on the same held-out windows of the training corpus. Then α on generated text: the in-process speculative loop
at temperature 1 (γ = 4) over held-out prompts, once per seed base for each draft. Texts
sampled by a speculative run move with the draft's proposals, so that α varies from seed
base to seed base (by 0.02–0.03 over 32 requests here) where the teacher-forced one does
not vary at all.
"""
from __future__ import annotations

import argparse
import copy

import torch

from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec import native
from specdec.quantize import quantize_linears_, round_linear_inputs_


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quant_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: the bundled draft)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: the bundled target)")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows (default 64)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per window (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--requests", type=int, default=32, help="generated requests per seed base (default 32; 0: none)")
    ap.add_argument("--seed-bases", default="1000,5000,9000", help="seed bases of the generated runs (default 1000,5000,9000)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generated request (default 64)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.windows < 1 or args.seq < 2:
        raise SystemExit("--windows must be at least 1 and --seq at least 2")
    try:
        seed_bases = [int(b) for b in args.seed_bases.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"--seed-bases takes integers, got {args.seed_bases!r}") from None
    if args.requests < 0 or args.max_new_tokens < 1 or (args.requests and not seed_bases):
        raise SystemExit("--requests must be at least 0, --max-new-tokens at least 1, and --seed-bases name one")
    from transformers import AutoTokenizer, LlamaForCausalLM

    from training.distill import heldout_agreement
    from training.train_pair import batches, encode_corpus

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    held = next(batches(encode_corpus(tok, "heldout"), args.windows, args.seq, torch.Generator().manual_seed(1234)))
    fp32 = argparse.Namespace(precision="fp32")
    int8 = copy.deepcopy(draft)
    quantize_linears_(int8)
    w8a8 = round_linear_inputs_(copy.deepcopy(int8))
    print(f"teacher-forced on {args.windows} held-out windows of {args.seq} tokens ({args.draft} against {args.target})")
    print("| draft weights | held-out α (t = 1) | greedy agreement | draft loss |\n|---|---|---|---|")
    for name, model in (("as stored", draft), ("int8", int8), ("w8a8", w8a8)):
        m = heldout_agreement(target, model, held, fp32)
        print(f"| {name} | {m['alpha_t1']:.4f} | {m['greedy_agreement']:.4f} | {m['draft_loss']:.4f} |")
    if args.requests:
        generated(args, tok, draft, target, seed_bases)
    return 0


def generated(args, tok, draft, target, seed_bases: list[int]) -> None:
    """α of the in-process loop at t = 1 on held-out prompts, per draft and seed base."""
    from benchmarks.inprocess import build_engines, run_spec_loop
    from benchmarks.runs import make_requests
    from training.corpus import heldout_prompts

    torch.set_num_threads(1)  # as a replica
    prompts = [tok(p)["input_ids"] for p in heldout_prompts(args.requests)]
    print(f"\ngenerated: temperature 1, γ = 4, {args.requests} held-out prompts × {args.max_new_tokens} tokens "
          "per seed base\n| draft weights | " + " | ".join(f"α (seeds {b}+)" for b in seed_bases) + " | mean |")
    print("|---" * (len(seed_bases) + 2) + "|")
    modes = [("as stored", "none"), ("int8", "int8")]
    if native.module() is not None and native.module().has_int8_dot():
        modes.append(("w8a8", "w8a8"))
    else:
        print("(no w8a8 row: this CPU has no 8-bit dot products)")
    for name, quantize in modes:
        engines = build_engines(copy.deepcopy(draft), target, quantize)
        alphas = [run_spec_loop(*engines, make_requests(prompts, args.requests, base), "t1", args.max_new_tokens,
                                tok.eos_token_id, 4).alpha for base in seed_bases]
        print(f"| {name} | " + " | ".join(f"{a:.3f}" for a in alphas) + f" | {sum(alphas) / len(alphas):.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
