"""Does torch.compile pay for the runner's forward here? `python -m benchmarks.compile_probe`.

Issue 4 asks for `torch.compile` where it pays. The runner's packed forward
(specdec.model_runner) loops over sessions in Python, which compiled code would have to
guard on, so this probe asks the question where compile has its best case: one session,
the shape of a decode step or a verification (1 or γ + 1 new tokens over a cache). It
writes that forward as one function of the session's KV buffer, the new tokens and the
start position (the runner's operators, in the runner's order, on the runner's own weight
tensors), checks that run eagerly it gives the runner's logits bit for bit, compiles it
(`torch.compile(dynamic=True, fullgraph=True)`: positions and lengths vary every call, and
the whole forward must be one graph) and times the
runner against the compiled function by turns, on the same cache length.

Measured on the 2-core CPU (2026-12-01 15:40 UTC, `--calls 100`; the draft with
`--model models/draft --calls 50`): for the bundled target compiling took 146 s and the
compiled forward was twice as slow, 16.91 ms against 7.70 ms for one token and 22.86
against 11.37 ms for five (logits within 6e-6); for the 1-layer draft compiling took 30 s
and gained 7–10 % (0.83 against 0.92 ms, 1.07 against 1.15 ms), about 0.4 ms of a
20 ms round, for half a minute more at every draft replica's start and one compiled shape
family per session count. So the runner stays eager on the CPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdec.model_runner import ForwardItem, ModelRunner
from specdec.models import BUNDLED_TARGET, load_model


def single_session_forward(runner: ModelRunner):
    """→ forward(kv, ids, start) → [n, vocab] logits: the runner's forward for one session
    whose cache buffer is `kv` ([layers, 2 × kv_heads, capacity, head_dim]), as one
    function that torch.compile can trace whole."""
    H, KV, D, L = runner.num_heads, runner.kv_heads, runner.head_dim, runner.max_length
    if runner.cos_table is None or any(layer.q_norm is not None for layer in runner.layers):
        raise SystemExit("the probe covers static-rotary models without per-head norms (Llama, Mistral, Qwen2)")
    gqa = {"enable_gqa": True} if KV != H else {}  # a literal: dynamic shapes would make KV != H symbolic

    def forward(kv: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
        n = ids.shape[0]
        cos, sin = runner.cos_table[start : start + n, None], runner.sin_table[start : start + n, None]
        mask = None if n == 1 else runner._band[:n, L - start : L + n]
        x = F.embedding(ids, runner.embed)
        for index, layer in enumerate(runner.layers):
            h = F.rms_norm(x, x.shape[-1:], layer.norm1, runner.eps)
            qkv = F.linear(h, layer.qkv.weight, layer.qkv.bias).view(n, H + 2 * KV, D)
            qk = qkv[:, : H + KV]
            turned = qk.roll(D // 2, -1).mul_(sin)
            qk.mul_(cos).add_(turned)
            kv[index, :, start : start + n] = qkv[:, H:].transpose(0, 1)
            keys, values = kv[index, :KV, : start + n], kv[index, KV:, : start + n]
            out = F.scaled_dot_product_attention(qk[:, :H].transpose(0, 1)[None], keys[None], values[None],
                                                 attn_mask=mask, scale=runner.scaling, **gqa)[0]
            x = x + F.linear(out.transpose(0, 1).reshape(n, H * D), layer.o.weight, layer.o.bias)
            h = F.rms_norm(x, x.shape[-1:], layer.norm2, runner.eps)
            gate, up = F.linear(h, layer.gate_up.weight, layer.gate_up.bias).chunk(2, -1)
            x = x + F.linear(runner.act(gate) * up, layer.down.weight, layer.down.bias)
        last = F.rms_norm(x, x.shape[-1:], runner.final_norm, runner.eps)
        return F.linear(last, runner.head.weight, runner.head.bias).float()

    return forward


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compile_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", default=str(BUNDLED_TARGET), help="model directory (default: the bundled target)")
    ap.add_argument("--cache", type=int, default=64, help="cached positions before each timed call (default 64)")
    ap.add_argument("--tokens", default="1,5", help="new tokens per call, comma-separated (default 1,5)")
    ap.add_argument("--calls", type=int, default=100, help="timed calls per system and size (default 100)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a replica)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(s) for s in args.tokens.split(",") if s]
    if args.cache < 1 or args.calls < 1 or not sizes or min(sizes) < 1 or args.cache + max(sizes) > 2048:
        raise SystemExit("--cache, --calls and --tokens must be positive, and cache + tokens at most 2048")
    torch.set_num_threads(args.threads)
    runner = ModelRunner(load_model(args.model, torch.device("cpu"), torch.float32), linear_kernels="aten", attention="sdpa")
    eager = single_session_forward(runner)
    ours, theirs = runner.new_cache(), runner.new_cache()
    prompt = torch.arange(args.cache) % runner.vocab_size
    with torch.inference_mode():
        runner.forward_packed([ForwardItem(ours, prompt, 1)])
        theirs.reserve(args.cache + max(sizes))
        eager(theirs.kv, prompt, 0)
        for n in sizes:
            ids = (torch.arange(n) * 7 + 3) % runner.vocab_size
            same = torch.equal(runner.forward_packed([ForwardItem(ours, ids, n)])[-1], eager(theirs.kv, ids, args.cache)[-1])
            ours.truncate(args.cache)
            print(f"eager single-session forward = the runner's logits, {n} token(s): {same}", flush=True)
            if not same:
                return 1
        compiled = torch.compile(eager, dynamic=True, fullgraph=True)  # one graph, or an error
        t0 = time.perf_counter()
        for n in sizes:
            compiled(theirs.kv, torch.arange(n), args.cache)
        print(f"compiled and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
        for n in sizes:
            ids = (torch.arange(n) * 7 + 3) % runner.vocab_size
            ref = runner.forward_packed([ForwardItem(ours, ids, n)])
            ours.truncate(args.cache)
            diff = (ref - compiled(theirs.kv, ids, args.cache)[-ref.shape[0]:]).abs().max().item()
            times = {"runner": [], "compiled": []}
            for _ in range(args.calls):
                for name in times:
                    t = time.perf_counter()
                    if name == "runner":
                        runner.forward_packed([ForwardItem(ours, ids, n)])
                        ours.truncate(args.cache)
                    else:
                        compiled(theirs.kv, ids, args.cache)
                    times[name].append((time.perf_counter() - t) * 1000)
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"{n} token(s) over {args.cache}: runner {med['runner']:.2f} ms, compiled {med['compiled']:.2f} ms "
                  f"(compiled ÷ runner {med['compiled'] / med['runner']:.2f}); max |logit difference| {diff:.1e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
