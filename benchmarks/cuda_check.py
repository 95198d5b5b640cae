"""Checks of the paths only a GPU takes, each against a reference, in about a minute: what
`benchmarks/gpu_kit.sh run` does on a lent GPU machine before `make bench` there, so that a
short lease shows what fails on CUDA, and where, before the benchmark's numbers.

- the runner's forward against Hugging Face's own, prompts and verifications fed at every
  start modulo 8, with SDPA per session (masks in aligned buffers, grouped query heads
  folded into rows) and with the paged caches' batched attention (a GPU's default), on the
  bundled target and on a tiny random grouped-query model, float32 and the 16-bit dtype of
  the device;
- a paged batch: sessions of other lengths, a prefill among verifications, a rollback and a
  fork, every session's logits against Hugging Face's over its text;
- the draft's wire encoding on the device against the host's, byte for byte;
- the verdicts over a draft's rows kept fp16 (a GPU servicer's) against those over its
  decoded float64 rows, to the bit;
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


def _judge(outs: list[torch.Tensor], texts: list[torch.Tensor], model, path, device, dtype) -> tuple[bool, str]:
    """float32: the runner's logits (the last rows of each text) within FP32_ATOL of Hugging
    Face's. 16 bits: as near to Hugging Face's float32 logits as Hugging Face's own forward
    in those 16 bits is (HALF_SLACK times its error, or FP32_ATOL)."""
    from specdec.models import load_model

    refs = [_hf_logits(model, ids)[-len(out):] for out, ids in zip(outs, texts)]
    if dtype == torch.float32:
        diff = max((out - ref).abs().max().item() for out, ref in zip(outs, refs))
        return diff <= FP32_ATOL, f"max |Δ| against Hugging Face's {diff:.2e}"
    exact_model = load_model(path, device, torch.float32)
    exact = [_hf_logits(exact_model, ids)[-len(out):] for out, ids in zip(outs, texts)]
    diff = max((out - e).abs().max().item() for out, e in zip(outs, exact))
    theirs = max((ref - e).abs().max().item() for ref, e in zip(refs, exact))
    return diff <= max(HALF_SLACK * theirs, FP32_ATOL), f"max |Δ| against float32 {diff:.2e}, Hugging Face's own {theirs:.2e}"


def check_forward(name: str, path, device: torch.device, dtype: torch.dtype, force_layout: bool,
                  attention: str = "sdpa") -> bool:
    """One session fed in chunks at every start modulo 8 (`_judge`)."""
    from specdec.model_runner import ModelRunner
    from specdec.models import load_model

    model = load_model(path, device, dtype)
    ids = torch.randint(0, model.config.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(1))
    runner = ModelRunner(model, attention=attention, fuse_layers=False)
    runner.device_layout = runner.device_layout or force_layout
    ok, words = _judge([_runner_logits(runner, ids)], [ids], model, path, device, dtype)
    print(f"forward  {name:7s} {attention:5s} {str(dtype):15s} {words}  {'ok' if ok else 'FAIL'}")
    return ok


def check_paged_batch(name: str, path, device: torch.device, dtype: torch.dtype, force_layout: bool) -> bool:
    """Rounds of a paged batch: four sessions (a 70-token prefill among them) fed 1–9
    tokens a round, a rejected token rolled back now and then, a fork of one joining midway
    (`_judge`, every round)."""
    from specdec.model_runner import ForwardItem, ModelRunner
    from specdec.models import load_model

    model = load_model(path, device, dtype)
    runner = ModelRunner(model, attention="paged")
    runner.device_layout = runner.device_layout or force_layout
    gen, V = torch.Generator().manual_seed(4), model.config.vocab_size
    feeds = [torch.randint(0, V, (n,), generator=gen) for n in (3, 70, 17, 1)]
    caches, texts, verdicts = [runner.new_cache() for _ in feeds], [torch.empty(0, dtype=torch.long)] * 4, []
    for step in range(4):
        if step == 2:
            caches.append(caches[1].fork(40, 60))
            texts.append(texts[1][:40])
            feeds.append(torch.randint(0, V, (5,), generator=gen))
        outs = [o.cpu() for o in runner.forward([ForwardItem(c, f, len(f)) for c, f in zip(caches, feeds)])]
        verdicts.append(_judge(outs, [torch.cat([t, f]) for t, f in zip(texts, feeds)], model, path, device, dtype))
        for i, (c, f) in enumerate(zip(caches, feeds)):
            keep = len(f) - (len(f) > 1 and (step + i) % 2)
            texts[i] = torch.cat([texts[i], f[:keep]])
            c.truncate(len(texts[i]))
        feeds = [torch.randint(0, V, (1 + (step + i) % 9,), generator=gen) for i in range(len(caches))]
    ok = all(good for good, _ in verdicts)
    words = next((words for good, words in verdicts if not good), verdicts[-1][1])  # the first failing round's
    print(f"batch    {name:7s} paged {str(dtype):15s} {words}  {'ok' if ok else 'FAIL'}")
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


def check_half_rows(device: torch.device, batches: int = 12) -> bool:
    """A GPU's target servicer keeps the draft's rows fp16 until read (specdec/draft_rows.py):
    its verdicts, decided on the device, must be those over the decoded float64 rows, to the
    bit, under both rules."""
    from specdec import sampling
    from specdec.model_runner import ModelRunner
    from specdec.models import BUNDLED_TARGET, load_model
    from specdec.sampling import SamplingParams
    from specdec.sessions import CacheRef
    from specdec.wire import decode, decode_half, encode, quantize
    from target_service.engine import TargetEngine, VerifyJob

    runner = ModelRunner(load_model(BUNDLED_TARGET, device, torch.float32))
    V, gen, ok = runner.vocab_size, torch.Generator().manual_seed(4), True
    laws = [SamplingParams(1.0, seed=4), SamplingParams(0.7, 0, 1.0, 9), SamplingParams(1.0, 40, 1.0, 2)]
    for rule in sampling.RULES:
        engine, same = TargetEngine(runner, rule=rule), 0
        for trial in range(batches):
            decoded, kept = [], []
            for b, params in enumerate(laws):
                gamma = 1 + (trial + b) % 5
                q16 = quantize(torch.softmax(torch.randn(gamma, V, generator=gen) * 3, -1))
                draft = torch.multinomial(q16, 1, generator=gen).view(-1).tolist()
                ref, enc = CacheRef(f"s{b}", 1, 0, [5]), encode(q16)
                decoded.append(VerifyJob(ref, draft, decode(enc, gamma), params))
                kept.append(VerifyJob(ref, draft, decode_half(enc, gamma), params))
            logits = (torch.randn(sum(len(j.draft_tokens) + 1 for j in decoded), V, generator=gen) * 3).to(device)
            same += engine._decide(kept, logits) == engine._decide(decoded, logits)
        ok &= same == batches
        print(f"verdicts {rule:5s} over fp16 rows == over float64 rows in {same} of {batches} batches  "
              f"{'ok' if same == batches else 'FAIL'}")
    return ok


def check_loop(device: torch.device, dtype: torch.dtype, prompts: int, tokens: int, attention: str = "auto") -> bool:
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

    draft = DraftEngine(ModelRunner(load_model(BUNDLED_DRAFT, device, dtype), attention=attention), 64)
    target = TargetEngine(ModelRunner(load_model(BUNDLED_TARGET, device, dtype), attention=attention), 64)
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
        print(f"loop     prompt {i} {target.runner.attention:5s} {str(dtype):15s} greedy {greedy_words} target-only "
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the GPU's layout forced)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts of the loop check (default 3)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens a loop check generates (default 48)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
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
                for attention in ("sdpa", "paged"):
                    ok &= _run(check_forward, name, path, device, dtype, force, attention)
                ok &= _run(check_paged_batch, name, path, device, dtype, force)
    ok &= _run(check_wire, device)
    ok &= _run(check_half_rows, device)
    for dtype in (torch.float32, half) if device.type == "cuda" else (torch.float32,):  # auto: paged on a GPU
        ok &= _run(check_loop, device, dtype, args.prompts, args.tokens, "auto" if device.type == "cuda" else "paged")
    print("all checks passed" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
