"""The training report is merged, not overwritten: each run adds its entry to what the
earlier runs wrote."""
import json

from training.checkpoints import update_report


def test_update_report_merges_into_what_is_there(tmp_path):
    update_report(tmp_path, lambda full: full.update(seed=0, params={"target": 10}))
    update_report(tmp_path, lambda full: full.setdefault("distill", []).append({"seed": 1}))
    update_report(tmp_path, lambda full: full["params"].update(draft=2))
    report = json.loads((tmp_path / "training_report.json").read_text())
    assert report == {"seed": 0, "params": {"target": 10, "draft": 2}, "distill": [{"seed": 1}]}


def test_precision_auto_follows_native_bf16_and_explicit_choices_win():
    import argparse

    import torch

    from training.checkpoints import autocast, resolve_precision

    assert resolve_precision("bf16") == "bf16" and resolve_precision("fp32") == "fp32"
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert resolve_precision("auto") == ("bf16" if native else "fp32")
    x = torch.ones(2, 2)
    with autocast(argparse.Namespace(precision="fp32")):
        assert (x @ x).dtype == torch.float32
    with autocast(argparse.Namespace(precision="bf16")):
        assert (x @ x).dtype == torch.bfloat16
