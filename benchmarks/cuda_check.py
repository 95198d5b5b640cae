"""Checks of the paths only a GPU takes, each against a reference, in about a minute: what
`benchmarks/gpu_kit.sh run` does on a lent GPU machine before `make bench` there, so that a
short lease shows what fails on CUDA, and where, before the benchmark's numbers.

- the runner's forward (SDPA per session: masks in aligned buffers, grouped query heads
  folded into rows) against Hugging Face's own, prompts and verifications fed at every start
  modulo 8, on the bundled target and on a tiny random grouped-query model, float32 and the
  16-bit dtype of the device;
- the draft's wire encoding on the device against the host's, byte for byte;
- the in-process speculative loop on the device: greedy token-identical to target-only
  greedy, and seeded t = 1 reproducible.

`--device cpu` runs the same checks here with the GPU's layout forced (the test suite does,
so that this script works when a device comes). Exit status 1 if a check fails; every
figure is printed either way.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

CHUNKS = (9, 1, 5, 3, 5, 6, 2, 5, 7, 5, 4, 8)  # fed in turn: starts at every residue modulo 8
FP32_ATOL = 2e-3  # float32 logits against Hugging Face's (TF32 is off for products by default)
HALF_SLACK = 2.0  # 16 bits: at most this many times the error of Hugging Face's forward in them


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None].to(model.device)).logits[0].float().cpu()


def _runner_logits(runner, ids: torch.Tensor) -> torch.Tensor:
    from specdec.model_runner import ForwardItem

    cache, start, outs = runner.new_cache(), 0, []
    for n in CHUNKS:
        outs.append(runner.forward([ForwardItem(cache, ids[start : start + n], n)])[0].cpu())
        start += n
    return torch.cat(outs)


def _tiny_gqa(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def check_forward(name: str, path, device: torch.device, dtype: torch.dtype, force_layout: bool) -> bool:
    """float32: the runner's logits within FP32_ATOL of Hugging Face's. 16 bits: the
    runner's as near to Hugging Face's float32 logits as Hugging Face's own forward in
    those 16 bits is (HALF_SLACK times its error, or FP32_ATOL)."""
    from specdec.model_runner import ModelRunner
    from specdec.models import load_model

    model = load_model(path, device, dtype)
    ids = torch.randint(0, model.config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(model, ids)
    runner = ModelRunner(model, attention="sdpa", fuse_layers=False)
    runner.device_layout = runner.device_layout or force_layout
    out = _runner_logits(runner, ids)
    if dtype == torch.float32:
        diff = (out - ref).abs().max().item()
        ok, words = diff <= FP32_ATOL, f"max |Δ| against Hugging Face's {diff:.2e}"
    else:
        exact = _hf_logits(load_model(path, device, torch.float32), ids)
        diff, theirs = (out - exact).abs().max().item(), (ref - exact).abs().max().item()
        ok = diff <= max(HALF_SLACK * theirs, FP32_ATOL)
        words = f"max |Δ| against float32 {diff:.2e}, Hugging Face's own {theirs:.2e}"
    print(f"forward  {name:7s} {str(dtype):15s} {words}  {'ok' if ok else 'FAIL'}")
    return ok


def check_wire(device: torch.device) -> bool:
    from specdec.wire import _encode_on_device, encode, quantize

    ok = True
    gen = torch.Generator().manual_seed(2)
    for keep in (None, 40):
        logits = torch.randn(4, 4096, generator=gen) * 3
        if keep is not None:
            cut = logits.topk(keep, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < cut, float("-inf"))
        q16 = quantize(logits.softmax(-1))
        on_device = encode(q16.to(device)) if device.type != "cpu" else _encode_on_device(q16)
        same = on_device == encode(q16)
        ok &= same
        print(f"wire     {'sparse' if keep else 'dense':7s} device encoding {'==' if same else '!='} host's  "
              f"{'ok' if same else 'FAIL'}")
    return ok


def check_loop(device: torch.device, dtype: torch.dtype, prompts: int, tokens: int) -> bool:
    """Greedy speculation token-identical to target-only greedy in float32; in 16 bits the
    products may round a verification's rows otherwise than one row's (cuBLAS picks its
    kernels by shape), so there the first difference is shown, not judged. A seeded t = 1
    answer repeats in either."""
    from draft_service.engine import DraftEngine
    from specdec import spec_loop
    from specdec.model_runner import ModelRunner
    from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_model
    from specdec.sampling import SamplingParams
    from target_service.engine import TargetEngine

    draft = DraftEngine(ModelRunner(load_model(BUNDLED_DRAFT, device, dtype)), 64)
    target = TargetEngine(ModelRunner(load_model(BUNDLED_TARGET, device, dtype)), 64)
    gen = torch.Generator().manual_seed(3)
    strict, ok = dtype == torch.float32, True
    for i in range(prompts):
        prompt = torch.randint(1, target.runner.vocab_size, (12 + 5 * i,), generator=gen).tolist()
        greedy = SamplingParams(temperature=0.0)
        t0 = time.perf_counter()
        spec = spec_loop.generate(draft, target, prompt, greedy, 4, tokens, session_id=f"g{i}")
        alone = spec_loop.generate(None, target, prompt, greedy, 0, tokens, session_id=f"t{i}")
        seeded = SamplingParams(temperature=1.0, seed=100 + i)
        first = spec_loop.generate(draft, target, prompt, seeded, 4, tokens, session_id=f"s{i}")
        again = spec_loop.generate(draft, target, prompt, seeded, 4, tokens, session_id=f"r{i}")
        differ = next((k for k, (a, b) in enumerate(zip(spec.tokens, alone.tokens)) if a != b), None)
        same, repeat = differ is None and len(spec.tokens) == len(alone.tokens), first.tokens == again.tokens
        passed = repeat and (same or not strict)
        ok &= passed
        greedy_words = "==" if same else f"differs from token {differ}" if differ is not None else "!="
        print(f"loop     prompt {i} {str(dtype):15s} greedy {greedy_words} target-only "
              f"(α {spec.stats.acceptance_rate:.2f}), seeded t=1 {'repeats' if repeat else 'DIFFERS'} "
              f"({time.perf_counter() - t0:.1f} s)  {'ok' if passed else 'FAIL'}")
    return ok


def _run(check, *args) -> bool:
    """A check's verdict; one that raises fails with its error, and the others still run."""
    try:
        return check(*args)
    except Exception as exc:  # what a GPU refuses: the point of running there
        print(f"{check.__name__}{args[:1]}: FAIL: {type(exc).__name__}: {exc}")
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the GPU's layout forced)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts of the loop check (default 3)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens a loop check generates (default 48)")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from specdec.models import BUNDLED_TARGET, ModelLoadError, pick_device, pick_dtype

    try:
        device = pick_device(args.device)
    except ModelLoadError as exc:
        ap.error(str(exc))
    half = pick_dtype("auto", device) if device.type == "cuda" else torch.bfloat16
    force = device.type == "cpu"
    if device.type == "cuda":
        print(f"device   {torch.cuda.get_device_name(device)}, torch {torch.__version__}, 16-bit dtype {half}")
    ok = True
    with tempfile.TemporaryDirectory() as tiny:
        for name, path in (("target", BUNDLED_TARGET), ("gqa", _tiny_gqa(tiny))):
            for dtype in (torch.float32, half):
                ok &= _run(check_forward, name, path, device, dtype, force)
    ok &= _run(check_wire, device)
    for dtype in (torch.float32, half) if device.type == "cuda" else (torch.float32,):
        ok &= _run(check_loop, device, dtype, args.prompts, args.tokens)
    print("all checks passed" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
