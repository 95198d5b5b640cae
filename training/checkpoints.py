"""What the training CLIs share: their common flags, and writing a trained model beside the
others with its entry in the models' `training_report.json`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch


def run_cli(ap: argparse.ArgumentParser, train: Callable[[argparse.Namespace], dict],
            argv: list[str] | None) -> None:
    """Add the flags every training run has, parse, and train."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train(args)


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
