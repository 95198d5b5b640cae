"""Deepen the bundled target and train it further.

A larger target is what speculative decoding is for: the draft's cost and each round's
fixed overhead (two RPCs and a Redis commit in the distributed pipeline) shrink beside a
target step. The target grows by interleaving a copy of each layer after it whose output
projections (attention `o_proj`, MLP `down_proj`) start at zero: every new layer adds
exactly nothing at first, so the deeper model begins with the trained one's outputs and
only gets better with training (next-token loss, as in `training.train_pair`).

Progress shows the training loss; the held-out loss is measured before and after, and the
report goes into the models' `training_report.json` under "deepen". The draft is then out
of step with the new target: distil it again (`python -m training.distill`).

Not part of `make models`: on the bundled pair, a 24-layer target reached a much better
held-out loss but the one-layer draft followed it less well, and the speedups fell
(models/README.md, "Tried: a deeper target"). Run it on a copy of the models directory.
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
from training.train_pair import batches, encode_corpus, heldout_loss, lr_at

ZEROED = ("self_attn.o_proj.", "mlp.down_proj.")  # a layer's writes into the residual stream


def layer_sources(have: int, layers: int) -> list[tuple[int, bool]]:
    """For each layer of the deepened model: (the trained layer it starts from, whether it
    is a new copy). Copies are spread evenly: each trained layer is followed by its own."""
    if layers < have:
        raise ValueError(f"cannot deepen a {have}-layer model to {layers} layers")
    extra = layers - have
    out: list[tuple[int, bool]] = []
    for j in range(have):
        copies = extra // have + (1 if j < extra % have else 0)
        out += [(j, False)] + [(j, True)] * copies
    return out


def deepen(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A `layers`-deep model that computes exactly what `model` computes."""
    have = model.config.num_hidden_layers
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    cfg.num_hidden_layers = layers
    deep = LlamaForCausalLM(cfg).to(next(model.parameters()).dtype)
    src = model.state_dict()
    state = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for i, (j, copy) in enumerate(layer_sources(have, layers)):
        prefix = f"model.layers.{j}."
        for key, value in src.items():
            if key.startswith(prefix):
                name = key[len(prefix):]
                value = torch.zeros_like(value) if copy and name.startswith(ZEROED) else value.clone()
                state[f"model.layers.{i}.{name}"] = value
    missing, unexpected = deep.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing  # tied to the embeddings
    deep.tie_weights()
    return deep


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    root = Path(args.models)
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    model = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    have = model.config.num_hidden_layers
    train_ids, held_ids = encode_corpus(tokenizer, "train"), encode_corpus(tokenizer, "heldout")
    before = heldout_loss(model, held_ids, args.seq)
    model = deepen(model, args.layers)
    grown = heldout_loss(model, held_ids, args.seq)
    print(f"held-out loss: {before:.4f} with {have} layers, {grown:.4f} deepened to {args.layers} (should match)")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    data = batches(train_ids, args.batch, args.seq, torch.Generator().manual_seed(args.seed + 100))
    t0 = time.time()
    bar = tqdm(range(args.steps), desc=f"training the {args.layers}-layer target", unit="step")
    for step in bar:
        xy = next(data)
        with autocast(args):
            logits = model(input_ids=xy[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), xy[:, 1:].flatten())
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup=args.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    seconds = round(time.time() - t0)
    after = heldout_loss(model, held_ids, args.seq)
    report = {"from_layers": have, "layers": args.layers, "steps": args.steps, "batch": args.batch,
              "seq": args.seq, "lr": args.lr, "seed": args.seed, "seconds": seconds,
              "tokens": args.steps * args.batch * args.seq, "params": model.num_parameters(),
              "heldout_loss": {"before": round(before, 4), "deepened": round(grown, 4), "after": round(after, 4)}}
    save_model(model, tokenizer, root / args.out)

    def edit(full: dict) -> None:
        full["deepen"] = report
        full["params"] = {**full.get("params", {}), "target": report["params"]}
        full.setdefault("heldout_loss", {})["target"] = report["heldout_loss"]["after"]

    update_report(root, edit)
    print(json.dumps(report, indent=2))
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training.deepen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models", help="directory with target/ (default: models)")
    ap.add_argument("--out", default="target", help="where the deepened target goes, under --models")
    ap.add_argument("--layers", type=int, default=24, help="layers of the deepened target (default 24)")
    ap.add_argument("--steps", type=int, default=700, help="optimizer steps (default 700)")
    ap.add_argument("--warmup", type=int, default=50, help="linear warm-up steps before the cosine decay (default 50)")
    return add_common_flags(ap, lr=1e-3)


def main(argv: list[str] | None = None) -> None:
    run_cli(build_parser(), train, argv)


if __name__ == "__main__":
    main()
