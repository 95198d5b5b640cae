"""Would the target be faster in another dtype, or with other matrix-product kernels, here?
`python -m benchmarks.dtype_probe`.

On a GPU the replicas serve bf16 or fp16 (`specdec.models.pick_dtype`); on a CPU they
serve fp32, and whether a CPU's bf16 kernels pay depends on the CPU: AMX tiles (Intel
Sapphire Rapids and later) make large bf16 matrix products several times faster, but a
decode step is a handful of rows, where the kernels' set-up and the other operators of a
layer weigh as much as the products. This loads the model once per dtype, builds a
`ModelRunner` of each, and times forwards of the shapes a replica runs — B sessions of
n new tokens each over caches of about `--context` positions (1×1 a draft or target-only
step, 1×5 one verification at γ = 4, 16×5 a full batch of them) — by turns, so that a slow
spell of a shared machine weighs on every dtype alike. It prints the median ms per forward
and each dtype's ratio to the first.

`--kernels aten,auto` compares the runner's products by MKL alone (`F.linear`) with the
kernels it picks at start-up (specdec.linear_kernels), and `--attention sdpa,native`
torch's attention per session with specdec.native's one call per layer: every (dtype,
kernels, attention) combination is a runner of its own, the first the reference.
`--attention sdpa,paged` compares attention per session with one over a batch of paged
caches (specdec.paged_attention: a GPU's default), and `--count-ops` prints the torch
operators each forward dispatches (the kernels a GPU launches, give or take the views
among them; a native kernel's call is none). `--model models/draft --quantize
none,int8,w8a8` compares a draft's 16-bit weights with its int8 ones and with int8 weights
and activations (specdec.quantize; a draft replica's `--quantize`), and `--fuse
on,layers,off` the native fusions.

The dtype changes the numbers the target computes, so it is a choice of the model served,
made for every replica at start (`--dtype` of the replicas), never per batch: the output is
exactly the served target's in either dtype, but not the same tokens in both.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.costs import sync_device
from specdec.linear_kernels import MODES
from specdec.model_runner import ForwardItem, ModelRunner
from specdec.models import BUNDLED_TARGET, load_model
from specdec.quantize import MODES as QUANTIZE_MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes: expected SESSIONSxTOKENS pairs like 1x1,16x5, got {text!r}") from None
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes: each shape is SESSIONSxTOKENS with both at least 1, got {text!r}")
    return shapes  # type: ignore[return-value]


class Shape:
    """B sessions whose caches hold `context` + 10·b positions, each fed n tokens a forward
    and cut back after it, so that every timed forward sees the same cache lengths."""

    def __init__(self, runner: ModelRunner, sessions: int, tokens: int, context: int) -> None:
        self.runner, self.tokens = runner, tokens
        self.lengths = [context + 10 * b for b in range(sessions)]
        self.caches = []
        for length in self.lengths:
            cache = runner.new_cache()
            runner.forward([ForwardItem(cache, torch.randint(0, runner.vocab_size, (length,)), 1)])
            self.caches.append(cache)

    def items(self) -> list[ForwardItem]:
        """A forward's items, the caches cut back to their lengths."""
        for cache, length in zip(self.caches, self.lengths):
            cache.truncate(length)
        return [ForwardItem(c, torch.randint(0, self.runner.vocab_size, (self.tokens,)), self.tokens)
                for c in self.caches]

    def forward_ms(self) -> float:
        items = self.items()
        t0 = time.perf_counter()
        self.runner.forward(items)
        sync_device(self.runner.device)
        return (time.perf_counter() - t0) * 1000


class OpCounter(TorchDispatchMode):
    """Counts the torch operators dispatched while on, and those of them that are not views."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.compute += torch.Tag.view_copy not in func.tags and not func.is_view
        return func(*args, **(kwargs or {}))


def count_ops(case: "Shape") -> tuple[int, int]:
    """(operators, of which not views) of one forward of `case`."""
    items = case.items()
    with OpCounter() as counter:
        case.runner.forward(items)
    return counter.ops, counter.compute


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dtype_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", default=str(BUNDLED_TARGET), help="model directory (default: the bundled target)")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help=f"dtypes to compare, the first the reference; of {', '.join(DTYPES)} (default float32,bfloat16)")
    ap.add_argument("--kernels", default="auto",
                    help="the runners' linear kernels to compare, of auto, aten, onednn (default auto)")
    ap.add_argument("--attention", default="auto",
                    help="the runners' attention to compare, of auto, native, sdpa, paged (default auto)")
    ap.add_argument("--count-ops", action="store_true",
                    help="also print the torch operators one forward of each dispatches (untimed)")
    ap.add_argument("--fuse", default="on",
                    help="native fusion: on (each layer one call, and a whole forward one call where it can), "
                         "layers (each layer one call only), off, or a list such as on,layers,off to compare "
                         "(default on)")
    ap.add_argument("--quantize", default="none",
                    help="the weights: none, int8, w8a8, or a list such as none,int8,w8a8 to compare "
                         "(a draft's option; default none)")
    ap.add_argument("--shapes", default="1x1,1x5,6x5,16x5",
                    help="SESSIONSxTOKENS forwards to time (default 1x1,1x5,6x5,16x5)")
    ap.add_argument("--context", type=int, default=150, help="cached positions per session (default 150)")
    ap.add_argument("--reps", type=int, default=15, help="timed forwards per shape and dtype (default 15)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a replica)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not names or set(names) - set(DTYPES):
        raise SystemExit(f"--dtypes takes names of {', '.join(DTYPES)}, got {args.dtypes!r}")
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels or set(kernels) - set(MODES):
        raise SystemExit(f"--kernels takes names of {', '.join(MODES)}, got {args.kernels!r}")
    attention = [a.strip() for a in args.attention.split(",") if a.strip()]
    if not attention or set(attention) - {"auto", "native", "sdpa", "paged"}:
        raise SystemExit(f"--attention takes names of auto, native, sdpa, paged, got {args.attention!r}")
    fuse = [f.strip() for f in args.fuse.split(",") if f.strip()]
    if not fuse or set(fuse) - {"on", "layers", "off"}:
        raise SystemExit(f"--fuse takes on, layers, off or a list of them, got {args.fuse!r}")
    quantize = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if not quantize or set(quantize) - set(QUANTIZE_MODES):
        raise SystemExit(f"--quantize takes names of {', '.join(QUANTIZE_MODES)}, got {args.quantize!r}")
    shapes = parse_shapes(args.shapes)
    if args.reps < 1 or args.context < 1:
        raise SystemExit("--reps and --context must be at least 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    variants = {}
    for d in names:
        for k in kernels:
            for a in attention:
                for f in fuse:
                    for q in quantize:
                        name = " ".join([d] + ([k] if len(kernels) > 1 else []) + ([a] if len(attention) > 1 else [])
                                        + ([f"fused-{f}"] if len(fuse) > 1 else []) + ([q] if len(quantize) > 1 else []))
                        variants[name] = (d, k, a, f, q)
    names = list(variants)
    runners = {}
    for name, (dtype, kernel, att, f, q) in variants.items():
        runners[name] = ModelRunner(load_model(args.model, device, DTYPES[dtype]), linear_kernels=kernel, attention=att,
                                    fuse_layers=f != "off", quantize=q, whole_forward=f == "on")
        r = runners[name]
        print(f"{name}: {r.kernels_summary}; fused layers {'on' if r.fused else 'off'}"
              + ("; whole forward in one call" if r.whole else ""))
    cases = {(n, s): Shape(runners[n], *s, args.context) for n in names for s in shapes}
    times: dict[tuple, list[float]] = {k: [] for k in cases}
    for case in cases.values():  # one untimed forward each: first-call allocations
        case.forward_ms()
    for _ in range(args.reps):
        for key, case in cases.items():
            times[key].append(case.forward_ms())
    print(f"median ms per forward over {args.reps} by turns ({args.model}, {device}, {args.threads} thread(s), "
          f"caches of about {args.context} positions)")
    for s in shapes:
        ref = statistics.median(times[(names[0], s)])
        cells = [f"{n} {statistics.median(times[(n, s)]):.3f} ms" + ("" if n == names[0] else
                 f" ({statistics.median(times[(n, s)]) / ref:.2f}×)") for n in names]
        print(f"{s[0]:>3} session(s) × {s[1]} token(s): " + ", ".join(cells))
    if args.count_ops:
        print("torch operators per forward (of which not views)")
        for s in shapes:
            counts = [count_ops(cases[(n, s)]) for n in names]
            print(f"{s[0]:>3} session(s) × {s[1]} token(s): "
                  + ", ".join(f"{n} {ops} ({compute})" for n, (ops, compute) in zip(names, counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
