"""Train the bundled target and its distilled draft.

The target learns next-token prediction; the draft is distilled from the target at the
same time (forward KL against the target's detached distribution, which raises the
acceptance rate α = Σ min(p, q) far more than plain cross-entropy), then for a final
phase against the frozen, fully trained target. Everything is seeded.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from training.checkpoints import add_common_flags, autocast, run_cli
from training.corpus import read_texts, source_files
from training.tokenizer import train_tokenizer

ARCH = {
    "target": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=4),
    "draft": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4),
}


def make_model(kind: str, vocab_size: int, eos_id: int, max_len: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_len, rms_norm_eps=1e-5,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        tie_word_embeddings=True, num_key_value_heads=ARCH[kind]["num_attention_heads"], **ARCH[kind],
    )
    return LlamaForCausalLM(cfg)


def encode_corpus(tokenizer, split: str) -> torch.Tensor:
    ids: list[int] = []
    for text in read_texts(source_files(split)):
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)
        yield data[idx]  # [batch, seq+1]


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL(p_target || q_draft), averaged over positions."""
    p_log = F.log_softmax(target_logits.float(), dim=-1)
    q_log = F.log_softmax(draft_logits.float(), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean()


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, seq: int, n_windows: int = 64) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    batch = next(batches(data, n_windows, seq, gen))
    losses = []
    for chunk in batch.split(16):
        out = model(input_ids=chunk[:, :-1])
        losses.append(F.cross_entropy(out.logits.flatten(0, 1).float(), chunk[:, 1:].flatten()))
    model.train()
    return float(torch.stack(losses).mean())


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    out = Path(args.out)
    tok_dir = out / "tokenizer"
    t0 = time.time()
    tokenizer = train_tokenizer(read_texts(source_files("train")), args.vocab_size, tok_dir)
    train_ids, held_ids = encode_corpus(tokenizer, "train"), encode_corpus(tokenizer, "heldout")
    print(f"corpus: {len(train_ids):,} training tokens, {len(held_ids):,} held-out tokens")
    target = make_model("target", len(tokenizer), tokenizer.eos_token_id, args.max_len)
    draft = make_model("draft", len(tokenizer), tokenizer.eos_token_id, args.max_len)
    opt_t = torch.optim.AdamW(target.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    opt_d = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq, gen)
    total = args.steps + args.distill_steps
    bar = tqdm(range(total), desc="training", unit="step")
    for step in bar:
        joint = step < args.steps
        xy = next(data)
        with autocast(args):
            with torch.set_grad_enabled(joint):
                t_logits = target(input_ids=xy[:, :-1]).logits
            d_logits = draft(input_ids=xy[:, :-1]).logits
        d_loss = distill_loss(d_logits, t_logits.detach())
        for g in opt_d.param_groups:
            g["lr"] = lr_at(step, total, args.lr)
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step()
        if joint:
            t_loss = F.cross_entropy(t_logits.flatten(0, 1).float(), xy[:, 1:].flatten())
            for g in opt_t.param_groups:
                g["lr"] = lr_at(step, args.steps, args.lr)
            opt_t.zero_grad(set_to_none=True)
            t_loss.backward()
            torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            opt_t.step()
            bar.set_postfix(target=f"{t_loss.item():.3f}", draft_kl=f"{d_loss.item():.3f}")
        else:
            target.eval()
            bar.set_postfix(phase="distill", draft_kl=f"{d_loss.item():.3f}")
    train_seconds = time.time() - t0
    report = {
        "seed": args.seed, "steps": args.steps, "distill_steps": args.distill_steps,
        "batch": args.batch, "seq": args.seq, "training_tokens": total * args.batch * args.seq,
        "train_seconds": round(train_seconds),
        "heldout_loss": {"target": heldout_loss(target, held_ids, args.seq),
                         "draft": heldout_loss(draft, held_ids, args.seq)},
        "params": {"target": target.num_parameters(), "draft": draft.num_parameters()},
        "corpus_tokens": {"train": len(train_ids), "heldout": len(held_ids)},
    }
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.pad_token_id = tokenizer.eos_token_id
        model.half().save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models", help="output directory (default: models)")
    ap.add_argument("--steps", type=int, default=1100, help="joint target+draft steps (default 1100)")
    ap.add_argument("--distill-steps", type=int, default=300, help="draft-only steps against the final target (default 300)")
    ap.add_argument("--vocab-size", type=int, default=4096, help="the tokenizer's vocabulary (default 4096)")
    ap.add_argument("--max-len", type=int, default=2048, help="max_position_embeddings of both models (default 2048)")
    return add_common_flags(ap, lr=2e-3)


def main(argv: list[str] | None = None) -> None:
    run_cli(build_parser(), train, argv)


if __name__ == "__main__":
    main()
