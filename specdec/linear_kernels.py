"""The packed forward's matrix products on a CPU, each by the faster of two kernels for
its number of rows.

A replica multiplies a few rows by each weight: one for a lone decode step, γ + 1 for a
verification, a few dozen for a batch. MKL's product (what `F.linear` calls) is the
fastest at one row, but from two rows on it repacks the weight on every call and costs
about what the arithmetic of many more rows would: on the AVX-512 EPYC the target's 49
products took 3.7 ms at one row and 7.3 at five. oneDNN's product over a weight packed
once at start-up stays near the one-row cost (3.8 ms at five rows, 4.3 at nine), because
a step is bound by streaming the weights, whatever the rows. Which kernel wins where
depends on the CPU, so a runner times both on its own shapes at start-up
(`calibrate`) and keeps, per range of row counts, the faster one.

The two kernels round differently in the last bits; either gives the model's numbers to
float precision (tests/specdec/test_linear_kernels.py), and speculation's output law does
not depend on which one ran.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MODES = ("auto", "aten", "onednn")
# row-count ranges timed apart: a product of n rows falls in the first range whose bound is
# ≥ n (the last one takes every larger n); each range is timed at its representative
BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128)
PROBES = (1, 2, 4, 6, 12, 24, 48, 96)
PACK_HINT = 16  # the row count oneDNN lays the weight out for (4..128 timed within 3 %)
MARGIN = 0.95  # oneDNN is kept only where it takes under this share of MKL's time


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


@dataclass
class KernelTable:
    """Per row count, whether oneDNN's packed product runs (else MKL's)."""
    packed: list[bool] = field(default_factory=lambda: [False] * len(BOUNDS))

    def use_packed(self, rows: int) -> bool:
        for bound, packed in zip(BOUNDS, self.packed):
            if rows <= bound:
                return packed
        return self.packed[-1]

    def describe(self) -> str:
        """'1: aten, 2-4: onednn, …' — ranges merged where the kernel is the same."""
        parts, lo = [], 1
        for i, (bound, packed) in enumerate(zip(BOUNDS, self.packed)):
            last = i == len(BOUNDS) - 1
            if last or self.packed[i + 1] != packed:
                hi = "" if last else str(bound)
                span = f"{lo}+" if last else (str(lo) if lo == bound else f"{lo}-{hi}")
                parts.append(f"{span}: {'onednn' if packed else 'aten'}")
                lo = bound + 1
        return ", ".join(parts)


class Product:
    """One weight (and bias) as the forward multiplies by it: `product(x)` is
    `F.linear(x, weight, bias)` by whichever kernel the table picks for x's rows."""

    __slots__ = ("weight", "bias", "packed", "table")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, table: KernelTable) -> None:
        self.weight, self.bias, self.table = weight, bias, table
        self.packed = None

    def pack(self) -> None:
        """oneDNN's copy of the weight, laid out once for its product."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), PACK_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and self.table.use_packed(x.shape[0]):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def aten(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def calibrate(sample: list[Product], table: KernelTable, mode: str, rounds: int = 5) -> dict[int, tuple[float, float]]:
    """Fill `table` for `mode` ("aten", "onednn" or "auto"). Under "auto", time both kernels
    over `sample` (packed products of every shape the forward uses: one layer's and the
    head) at each range's representative row count, by turns, best of `rounds`, and keep
    oneDNN where it is faster by the margin. Returns {rows: (aten ms, onednn ms)}, empty
    unless timed."""
    if mode not in MODES:
        raise ValueError(f"linear kernels must be one of {', '.join(MODES)}, not {mode!r}")
    table.packed = [mode == "onednn"] * len(BOUNDS)
    if mode != "auto" or not sample:
        return {}
    timings = {}
    for rows in PROBES:
        xs = [torch.randn(rows, p.weight.shape[1], dtype=p.weight.dtype, device=p.weight.device) for p in sample]
        best = [float("inf"), float("inf")]
        for _ in range(rounds + 1):  # the first round also creates oneDNN's kernels for the shape
            for k, kernel in enumerate((Product.aten, Product.onednn)):
                t0 = time.perf_counter()
                for p, x in zip(sample, xs):
                    kernel(p, x)
                best[k] = min(best[k], time.perf_counter() - t0)
        timings[rows] = (best[0] * 1e3, best[1] * 1e3)
    table.packed = [timings[r][1] < MARGIN * timings[r][0] for r in PROBES]
    return timings
