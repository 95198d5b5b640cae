"""Would one attention call for a whole batch beat one call per session? `python -m benchmarks.attention_probe`.

`ModelRunner` packs every session's new tokens into one sequence for the matrix products,
but attends per session (a cache write, two views and one SDPA call each, per layer): 192
calls in a forward of 16 sessions through the 12-layer target. The alternative is a slot
layout — every session's cache a slot of one [slots, 2 × kv_heads, capacity, head_dim]
tensor per layer — so that a batch writes its new keys with one indexed copy and attends
with one SDPA call over its slots, padded to the longest session and masked.

This measures one layer's attention both ways, interleaved, on the shapes of the model's
config (no weights needed), for batches of sessions whose cache lengths are drawn from a
range, each feeding `--tokens` new tokens (γ + 1 of a verification):

- alone: what the runner does now (write, views, SDPA with its causal mask);
- together: one index write and one SDPA over the batch's slots (a contiguous view:
  the best case of a slot layout, no gather);
- gathered: the same when the batch's slots are not contiguous in the pool (every other
  slot here), so that an index_select copies them first;

and prints µs per layer, the saving over all layers of a forward, the padding (keys
attended ÷ keys needed) and the arithmetic rate of the batched call. The masks are built
outside the timing in both (the runner takes them from a table).
"""
from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from specdec.models import BUNDLED_TARGET


def parse_ranges(text: str) -> list[tuple[int, int]]:
    try:
        ranges = [tuple(int(x) for x in part.split("-")) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths: expected ranges like 40-150,40-500, got {text!r}") from None
    if any(len(r) != 2 or not 1 <= r[0] <= r[1] for r in ranges):
        raise SystemExit(f"--lengths: each range is LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return ranges  # type: ignore[return-value]


class Case:
    """One batch: its sessions' caches as slots of one pool, and both ways to attend."""

    def __init__(self, heads: int, kv_heads: int, dim: int, lengths: list[int], n: int) -> None:
        self.H, self.KV, self.n, self.starts = heads, kv_heads, n, lengths
        B, self.end = len(lengths), max(lengths) + n
        self.pool = torch.randn(B, 2 * kv_heads, self.end, dim)
        self.sparse = torch.randn(2 * B, 2 * kv_heads, self.end, dim)  # the batch in the even slots
        self.even = torch.arange(0, 2 * B, 2)
        self.q = torch.randn(heads, B * n, dim)
        self.kv = torch.randn(2 * kv_heads, B * n, dim)
        rows = torch.arange(n)
        # as the runner: no mask for one new token (it sees its whole cache)
        self.masks = [None if n == 1 else torch.arange(s + n)[None] <= (s + rows)[:, None] for s in lengths]
        sees = torch.tensor(lengths)[:, None] + rows[None]  # [B, n]
        self.mask = (torch.arange(self.end)[None, None] <= sees[:, :, None])[:, None]  # [B, 1, n, end]
        self.slot = torch.arange(B).repeat_interleave(n)
        self.sparse_slot = self.even.repeat_interleave(n)
        self.pos = sees.reshape(-1)
        self.gqa = kv_heads != heads

    def alone(self) -> torch.Tensor:
        outs, KV, n = [], self.KV, self.n
        for b, (s, mask) in enumerate(zip(self.starts, self.masks)):
            self.pool[b, :, s : s + n] = self.kv[:, b * n : (b + 1) * n]
            keys, values = self.pool[b, :KV, : s + n], self.pool[b, KV:, : s + n]
            outs.append(F.scaled_dot_product_attention(self.q[None, :, b * n : (b + 1) * n], keys[None],
                                                       values[None], attn_mask=mask, enable_gqa=self.gqa)[0])
        return torch.cat(outs, 1)  # [heads, B × n, dim]

    def together(self) -> torch.Tensor:
        self.pool[self.slot, :, self.pos] = self.kv.transpose(0, 1)
        return self._attend(self.pool)

    def gathered(self) -> torch.Tensor:
        self.sparse[self.sparse_slot, :, self.pos] = self.kv.transpose(0, 1)
        return self._attend(self.sparse.index_select(0, self.even))

    def _attend(self, held: torch.Tensor) -> torch.Tensor:
        KV, B, n = self.KV, len(self.starts), self.n
        q = self.q.view(self.H, B, n, -1).transpose(0, 1)  # [B, heads, n, dim]
        out = F.scaled_dot_product_attention(q, held[:, :KV], held[:, KV:], attn_mask=self.mask, enable_gqa=self.gqa)
        return out.transpose(0, 1).reshape(self.H, B * n, -1)

    @property
    def padding(self) -> float:
        return self.end * len(self.starts) / sum(s + self.n for s in self.starts)

    def flops(self) -> float:
        """Multiply-adds ×2 of the batched call (scores and weighted sum)."""
        return 4.0 * len(self.starts) * self.H * self.n * self.end * self.q.shape[-1]


def median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e6


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attention_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED_TARGET), help="model directory whose config sets the shapes")
    ap.add_argument("--batches", default="4,16", help="sessions per batch, comma-separated (default 4,16)")
    ap.add_argument("--lengths", default="40-150,40-500",
                    help="cache-length ranges to draw from, comma-separated LOW-HIGH (default 40-150,40-500)")
    ap.add_argument("--tokens", type=int, default=5, help="new tokens per session (default 5: γ = 4)")
    ap.add_argument("--reps", type=int, default=50, help="timed calls of each way per case (default 50)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches: expected integers like 4,16, got {args.batches!r}") from None
    if any(b < 1 for b in batches) or args.tokens < 1 or args.reps < 1:
        raise SystemExit("--batches, --tokens and --reps must be >= 1")
    ranges = parse_ranges(args.lengths)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    torch.set_num_threads(1)
    print(f"{args.model}: {layers} layers, {heads} heads ({kv_heads} kv), head dim {dim}; "
          f"{args.tokens} new tokens a session; one torch thread; medians of {args.reps}\n")
    print("| sessions | cache lengths | padding | alone µs/layer | together µs/layer | gathered µs/layer "
          "| together ÷ alone | gathered ÷ alone | together saves ms/forward | together GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    with torch.inference_mode():
        for B in batches:
            for lo, hi in ranges:
                case = Case(heads, kv_heads, dim, [rng.randint(lo, hi) for _ in range(B)], args.tokens)
                case.sparse[case.even] = case.pool  # the same caches in the even slots
                reference = case.alone()
                for way in (case.together, case.gathered):
                    torch.testing.assert_close(way(), reference, rtol=1e-4, atol=1e-5)
                ways = (case.alone, case.together, case.gathered)
                times: list[list[float]] = [[], [], []]
                for _ in range(3):  # interleaved thirds: drift hits every way alike
                    for way, ts in zip(ways, times):
                        way()
                        ts.append(median_us(way, args.reps))
                a, t, g = (sorted(ts)[1] for ts in times)
                print(f"| {B} | {lo}–{hi} | {case.padding:.2f} | {a:.0f} | {t:.0f} | {g:.0f} | {t / a:.2f} | {g / a:.2f} "
                      f"| {(a - t) * layers / 1000:.2f} | {case.flops() / t / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
