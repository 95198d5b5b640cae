"""The packed forward's matrix products on a CPU, each by the fastest of up to three
kernels for its number of rows.

A replica multiplies a few rows by each weight: one for a lone decode step, γ + 1 for a
verification, a few dozen for a batch, and on a CPU such a product costs about what
streaming its weight costs. The kernels:

- "aten": `F.linear` (MKL on a CPU). The fastest float32 kernel at one row, but from two
  rows on it repacks the weight on every call: on the AVX-512 EPYC the target's 49
  products took 3.7 ms at one row and 7.3 at five.
- "onednn": oneDNN's product over a weight packed once at start-up, which stays near the
  one-row cost (3.8 ms at five rows, 4.3 at nine).
- "half": where every weight of the model is a 16-bit value (a float16 or bfloat16
  checkpoint served in float32, as the bundled pair), the weights held in 16 bits and
  widened in the kernel (specdec.half_weights): the same numbers from half the bytes
  (2.5 ms at one row, 3.2 at five).

Which wins where depends on the CPU, so a runner times the kernels it has on its own
weights at start-up (`calibrate`) and keeps one kernel for every row count: the compact,
batch-invariant one unless another takes under INVARIANT_MARGIN of its time, else the
fastest over all of them, and another at a range only where it is more than twice as fast
there (`choose`). The kernels round differently in the last bits; each gives the model's numbers
to float precision (tests/specdec/test_linear_kernels.py), and speculation's output law does not
depend on which one ran.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec import half_weights, native

log = logging.getLogger(__name__)

KERNELS = ("aten", "onednn", "half")
MODES = ("auto",) + KERNELS
# row-count ranges timed apart: a product of n rows falls in the first range whose bound is
# ≥ n (the last one takes every larger n); each range is timed at its representative
BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128)
PROBES = (1, 2, 4, 6, 12, 24, 48, 96)
PACK_HINT = 16  # the row count oneDNN lays the weight out for (4..128 timed within 3 %)
MARGIN = 0.95  # another kernel replaces aten only where it takes under this share of aten's time
# the compact kernel, batch-invariant, gives way to another only where that one takes under this
# share of its time: a session's bits then do not depend on its batch company, which seeded
# samples reproduce by, for at most a quarter more product time
INVARIANT_MARGIN = 0.8
EXCEPTION = 0.5  # a range leaves the one kernel of every range only for one under this share of its time
SAMPLE_BYTES = 64 << 20  # calibrate over weights of at least this size (more than a CPU's L3), or all


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


@dataclass
class KernelTable:
    """Per range of row counts, the kernel that runs (an index into KERNELS)."""
    kernels: list[int] = field(default_factory=lambda: [0] * len(BOUNDS))

    def kernel(self, rows: int) -> int:
        for bound, k in zip(BOUNDS, self.kernels):
            if rows <= bound:
                return k
        return self.kernels[-1]

    def used(self) -> set[str]:
        return {KERNELS[k] for k in self.kernels}

    def describe(self) -> str:
        """'1: aten, 2-8: half, 9+: onednn': ranges merged where the kernel is the same."""
        parts, lo = [], 1
        for i, (bound, k) in enumerate(zip(BOUNDS, self.kernels)):
            last = i == len(BOUNDS) - 1
            if last or self.kernels[i + 1] != k:
                span = f"{lo}+" if last else (str(lo) if lo == bound else f"{lo}-{bound}")
                parts.append(f"{span}: {KERNELS[k]}")
                lo = bound + 1
        return ", ".join(parts)


class Product:
    """One weight (and bias) as the forward multiplies by it: `product(x)` is
    `F.linear(x, weight, bias)` by whichever kernel the table picks for x's rows."""

    __slots__ = ("weight", "bias", "table", "packed", "half", "int8")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, table: KernelTable,
                 int8: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`int8`: where the weight is int8 values times row scales (specdec.quantize), those
        factors, which the compact kernel then streams."""
        self.weight, self.bias, self.table, self.int8 = weight, bias, table, int8
        self.packed = self.half = None

    def pack_onednn(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), PACK_HINT)

    def pack_half(self, dtype: torch.dtype, panel: int) -> None:
        with torch.no_grad():
            self.half = half_weights.pack(self.weight, dtype, panel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.table.kernel(x.shape[0])
        if k == 2:
            return native.module().half_linear(x, self.half, self.weight.shape[0], self.bias)
        if k == 1:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def run(self, kernel: int, x: torch.Tensor) -> torch.Tensor:
        """`x` through the given kernel, whatever the table says (for timing)."""
        if kernel == 2:
            return native.module().half_linear(x, self.half, self.weight.shape[0], self.bias)
        if kernel == 1:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepare(products: list[Product], table: KernelTable, mode: str, device: torch.device,
            dtype: torch.dtype, int8_dot: bool = False) -> dict[int, dict[str, float]]:
    """Give the products the copies their kernels need and fill `table` for `mode`: one
    kernel everywhere, or under "auto" the fastest of those this machine has, per range
    (`calibrate`). Copies no range uses are dropped. Returns the timings (empty unless
    timed). Where every product carries int8 factors (a quantised draft), the compact kernel
    ("half") streams those instead of 16-bit values, laid out for 8-bit dot products with
    int8 activations where `int8_dot` (specdec.quantize's "w8a8")."""
    if mode not in MODES:
        raise ValueError(f"linear kernels must be one of {', '.join(MODES)}, not {mode!r}")
    int8 = bool(products) and all(p.int8 is not None for p in products)
    have = ["aten"]
    if mode in ("auto", "onednn"):
        if onednn_available(device, dtype):
            have.append("onednn")
        elif mode == "onednn":
            raise ValueError(f"oneDNN's products need a CPU and float32 or bfloat16 weights, "
                             f"not {device.type} {dtype}")
    if mode in ("auto", "half"):
        why = _half_unavailable(products, device, dtype, int8)
        if why is None:
            have.append("half")
        elif mode == "half":
            raise ValueError(f"16-bit weights cannot serve this model: {why}")
    if "onednn" in have:
        for p in products:
            p.pack_onednn()
    if "half" in have:
        panel = native.module().panel_width()
        if int8:
            for p in products:
                p.half = half_weights.pack_int8_dot(*p.int8) if int8_dot else half_weights.pack_int8(*p.int8, panel)
                p.int8 = None  # packed: a product keeps one int8 copy (the model keeps its factors)
        else:
            for p in products:
                p.pack_half(half_weights.lossless_dtype(p.weight), panel)
    timings = {}
    if mode == "auto" and len(have) > 1:
        timings = calibrate(_sample(products), table, [KERNELS.index(k) for k in have])
    else:
        table.kernels = [KERNELS.index(mode if mode != "auto" else "aten")] * len(BOUNDS)
    used = table.used()
    for p in products:
        if "onednn" not in used:
            p.packed = None
        if "half" not in used:
            p.half = None
    return timings


def _half_unavailable(products: list[Product], device: torch.device, dtype: torch.dtype,
                      int8: bool = False) -> str | None:
    """Why the compact kernel (16-bit weights, or int8 ones once quantised) cannot serve
    these weights, or None if it can."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"it serves float32 models on a CPU, not {device.type} {dtype}"
    if not products or (not int8 and any(half_weights.lossless_dtype(p.weight) is None for p in products)):
        return "some weights are not float16 or bfloat16 values"
    if native.module() is None:
        return f"the kernel did not build: {native.unavailable_reason()}"
    return None


def _sample(products: list[Product]) -> list[Product]:
    """Products whose weights add up to SAMPLE_BYTES (or all): a working set as large as a
    forward's, so that each kernel is timed streaming its weights from memory, as it will."""
    sample, total = [], 0
    for p in products:
        sample.append(p)
        total += p.weight.numel() * p.weight.element_size()
        if total >= SAMPLE_BYTES:
            break
    return sample


def calibrate(sample: list[Product], table: KernelTable, kernels: list[int],
              rounds: int = 3) -> dict[int, dict[str, float]]:
    """Time `kernels` (indices into KERNELS, aten first) over `sample` at each range's
    representative row count, by turns, best of `rounds`, and fill `table` by `choose`.
    Returns {rows: {kernel: ms}}."""
    timings = _time(sample, kernels, rounds)
    table.kernels = choose(timings)
    if "half" in timings[PROBES[0]] and table.used() != {"half"}:
        # the compact kernel lost somewhere: time it all again and choose by the best of both
        # passes, so that a burst of load in one pass (a replica started beside busy ones)
        # does not cost the replica its batch invariance for its whole life
        again = _time(sample, kernels, rounds)
        timings = {rows: {k: min(ms, again[rows][k]) for k, ms in t.items()} for rows, t in timings.items()}
        table.kernels = choose(timings)
    return timings


def _time(sample: list[Product], kernels: list[int], rounds: int) -> dict[int, dict[str, float]]:
    timings = {}
    for rows in PROBES:
        xs = [torch.randn(rows, p.weight.shape[1], dtype=p.weight.dtype, device=p.weight.device) for p in sample]
        best = {k: float("inf") for k in kernels}
        for _ in range(rounds + 1):  # the first round also creates oneDNN's kernels for the shape
            for k in kernels:
                t0 = time.perf_counter()
                for p, x in zip(sample, xs):
                    p.run(k, x)
                best[k] = min(best[k], time.perf_counter() - t0)
        timings[rows] = {KERNELS[k]: t * 1e3 for k, t in best.items()}
    return timings


def choose(timings: dict[int, dict[str, float]]) -> list[int]:
    """Per range of row counts (PROBES, by its representative's timings in ms), the kernel
    that runs: one kernel for every range, the one whose time per row summed over the
    ranges is least (a decode step's few rows weigh as much as a prefill's many; another
    kernel replaces aten only under MARGIN of its sum, and the compact kernel only under
    INVARIANT_MARGIN of its own), except where another takes under EXCEPTION of its time at
    that range. Kernels round their last bits differently, so one
    kernel over every row count is what makes a forward's bits independent of how many rows
    it has (its batch company, how a prompt was chunked): with the compact kernel and
    native attention the bundled pair's logits are bit for bit the same alone, in company
    and fed token by token (tests/specdec/test_model_runner.py). Per range, start-up timings
    are too noisy to choose by: on a loaded machine replicas took "1-4: half, 5-8: onednn,
    9+: half" where the compact kernel is 2.3 times faster at 6 rows, and their seeded
    samples then differed from the other replicas' (benchmarks/HISTORY.md, "Drains that
    hung")."""
    names = list(next(iter(timings.values())))
    per_row = {k: sum(timings[rows][k] / rows for rows in PROBES) for k in names}
    best = min(per_row, key=per_row.get)
    if "half" in per_row and per_row[best] >= INVARIANT_MARGIN * per_row["half"]:
        base = "half"  # batch-invariant: kept within INVARIANT_MARGIN
    else:
        base = best if best == "aten" or per_row[best] < MARGIN * per_row["aten"] else "aten"
    chosen = []
    for rows in PROBES:
        t = timings[rows]
        fastest = min(t, key=t.get)
        chosen.append(KERNELS.index(fastest if t[fastest] < EXCEPTION * t[base] else base))
    return chosen
