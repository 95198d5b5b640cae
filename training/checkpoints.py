"""What the training CLIs share: their common flags, and writing a trained model beside the
others with its entry in the models' `training_report.json`."""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Callable

import torch


def add_common_flags(ap: argparse.ArgumentParser, lr: float) -> argparse.ArgumentParser:
    """The flags every training run has; `lr` is the run's default peak learning rate."""
    ap.add_argument("--batch", type=int, default=16, help="sequences a step (default 16)")
    ap.add_argument("--seq", type=int, default=256, help="tokens a sequence (default 256)")
    ap.add_argument("--lr", type=float, default=lr, help=f"AdamW peak learning rate (default {lr:g})")
    ap.add_argument("--seed", type=int, default=0, help="seeds the data order and initialisation (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="forward precision: bf16 autocast or fp32 (auto: bf16 where the CPU "
                         "has native bf16 arithmetic, fp32 where it would be emulated)")
    return ap


def run_cli(ap: argparse.ArgumentParser, train: Callable[[argparse.Namespace], dict],
            argv: list[str] | None) -> None:
    """Parse (`ap` from `add_common_flags`) and train."""
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.precision = resolve_precision(args.precision)
    print(f"forward precision: {args.precision}")
    train(args)


def resolve_precision(precision: str) -> str:
    """"bf16" or "fp32" for `--precision`. auto trains under bf16 autocast only where the CPU
    has native bf16: on one without it (AVX2 only) every bf16 product is emulated, and a
    4096 x 256 x 4096 product took 5.5x its fp32 time on the AVX2 EPYC and a distillation
    step 26 s against 2.0 s in fp32."""
    if precision != "auto":
        return precision
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


def autocast(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The training forwards' precision context, as `--precision` resolved."""
    if args.precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def save_model(model, tokenizer, out: Path) -> None:
    """fp16 weights; the tokenizer only into a new directory, so that re-saving it does not
    rewrite the shipped tokenizer files with this machine's loading flags."""
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.half().save_pretrained(out)
    if not (out / "tokenizer.json").exists():
        tokenizer.save_pretrained(out)


def update_report(root: Path, edit: Callable[[dict], None]) -> None:
    """Apply `edit` to the models' training report (created if missing) and write it back."""
    path = root / "training_report.json"
    full = json.loads(path.read_text()) if path.exists() else {}
    edit(full)
    path.write_text(json.dumps(full, indent=2) + "\n")
