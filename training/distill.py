"""Distil the bundled draft further against the frozen, trained target.

Speculative decoding accepts a draft token with probability Σ min(p, q) = 1 − TV(p, q),
so the acceptance rate α is the quantity to train for: the loss here is the total
variation distance itself (as in DistillSpec, Zhou et al. 2024), with a little forward
KL that keeps gradients flowing to tokens where q is far below p and TV is flat. The
draft can also grow: new layers start as exact identities (zeroed output projections),
so a grown draft begins where the old one ended and only gets better.

Progress shows the held-out α at temperature 1 (teacher-forced: the mean of Σ min(p, q)
over held-out positions) and the greedy agreement (argmax p = argmax q); the best
checkpoint by α is the one written.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM

from training.checkpoints import add_common_flags, autocast, run_cli, save_model, update_report
from training.train_pair import batches, encode_corpus, lr_at


def grow(draft: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """Append layers that compute the identity until the draft has `layers` layers."""
    have = draft.config.num_hidden_layers
    if layers <= have:
        return draft
    cfg = draft.config
    cfg.num_hidden_layers = layers
    grown = LlamaForCausalLM(cfg)
    missing, unexpected = grown.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected, unexpected
    for layer in grown.model.layers[have:]:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    return grown


def alpha_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, kl_weight: float) -> torch.Tensor:
    """TV(p, q) + kl_weight · KL(p ‖ q), averaged over positions."""
    p_log = F.log_softmax(target_logits.float(), dim=-1)
    q_log = F.log_softmax(draft_logits.float(), dim=-1)
    p = p_log.exp()
    tv = 0.5 * (p - q_log.exp()).abs().sum(-1)
    kl = (p * (p_log - q_log)).sum(-1)
    return (tv + kl_weight * kl).mean()


@torch.no_grad()
def heldout_agreement(target, draft, windows: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """Teacher-forced α at temperature 1, greedy agreement, and the draft's loss."""
    draft.eval()
    alphas, greedy, losses = [], [], []
    for chunk in windows.split(16):
        with autocast(args):
            t_logits = target(input_ids=chunk[:, :-1]).logits.float()
            d_logits = draft(input_ids=chunk[:, :-1]).logits.float()
        p, q = t_logits.softmax(-1), d_logits.softmax(-1)
        alphas.append(torch.minimum(p, q).sum(-1).mean())
        greedy.append((t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean())
        losses.append(F.cross_entropy(d_logits.flatten(0, 1), chunk[:, 1:].flatten()))
    draft.train()
    mean = lambda xs: round(float(torch.stack(xs).mean()), 4)  # noqa: E731
    return {"alpha_t1": mean(alphas), "greedy_agreement": mean(greedy), "draft_loss": mean(losses)}


def distill(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    root = Path(args.models)
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    target = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    target.requires_grad_(False)
    draft = grow(LlamaForCausalLM.from_pretrained(root / args.init, dtype=torch.float32), args.layers)
    draft.train()
    train_ids, held_ids = encode_corpus(tokenizer, "train"), encode_corpus(tokenizer, "heldout")
    held = next(batches(held_ids, args.eval_windows, args.seq, torch.Generator().manual_seed(1234)))
    before = heldout_agreement(target, draft, held, args)
    print(f"before: {before}")
    best, best_state = before, None
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    data = batches(train_ids, args.batch, args.seq, torch.Generator().manual_seed(args.seed + 1))
    t0 = time.time()
    bar = tqdm(range(args.steps), desc="distilling draft", unit="step")
    for step in bar:
        xy = next(data)
        with autocast(args):
            with torch.no_grad():
                t_logits = target(input_ids=xy[:, :-1]).logits
            d_logits = draft(input_ids=xy[:, :-1]).logits
        loss = alpha_loss(d_logits, t_logits, args.kl_weight)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup=args.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.4f}", best_alpha=best["alpha_t1"])
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            now = heldout_agreement(target, draft, held, args)
            tqdm.write(f"step {step + 1}: {now}")
            if now["alpha_t1"] > best["alpha_t1"]:
                best, best_state = now, {k: v.detach().clone() for k, v in draft.state_dict().items()}
    seconds = round(time.time() - t0)
    report = {"init": args.init, "layers": draft.config.num_hidden_layers, "steps": args.steps,
              "batch": args.batch, "seq": args.seq, "lr": args.lr, "kl_weight": args.kl_weight,
              "seed": args.seed, "precision": args.precision, "seconds": seconds,
              "tokens": args.steps * args.batch * args.seq,
              "before": before, "after": best, "params": draft.num_parameters()}
    if best_state is not None:
        draft.load_state_dict(best_state)
        save_model(draft, tokenizer, root / args.out)

        def edit(full: dict) -> None:
            full["distill"] = [*full.get("distill", []), report]  # one entry per distillation run
            full["params"] = {**full.get("params", {}), "draft": draft.num_parameters()}
            full.setdefault("heldout_loss", {})["draft"] = best["draft_loss"]

        update_report(root, edit)
    print(json.dumps(report, indent=2))
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training.distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models", help="directory with target/ and the draft (default: models)")
    ap.add_argument("--init", default="draft", help="draft to start from, under --models (default: draft)")
    ap.add_argument("--out", default="draft", help="where the distilled draft goes, under --models")
    ap.add_argument("--layers", type=int, default=0, help="grow the draft to this many layers (0: keep)")
    ap.add_argument("--steps", type=int, default=800, help="optimizer steps (default 800)")
    ap.add_argument("--warmup", type=int, default=50, help="linear warm-up steps before the cosine decay (default 50)")
    ap.add_argument("--kl-weight", type=float, default=0.1, help="weight of forward KL beside TV")
    ap.add_argument("--eval-every", type=int, default=200, help="steps between held-out α checks; the best checkpoint is kept (default 200)")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out 256-token windows for α")
    return add_common_flags(ap, lr=1e-3)


def main(argv: list[str] | None = None) -> None:
    run_cli(build_parser(), distill, argv)


if __name__ == "__main__":
    main()
