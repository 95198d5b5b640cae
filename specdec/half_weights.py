"""Weights held in 16 bits where that loses nothing, for the CPU's decode steps.

A decode step or a verification multiplies a few rows by every weight, so on a CPU its
matrix products cost what streaming the weights costs. Checkpoints are commonly stored in
float16 or bfloat16 (the bundled pair in float16) and served in float32 on a CPU, where
every weight is then a 16-bit value held in 32 bits. Held in 16 bits and widened in the
kernel (specdec/native/half_linear.cpp), the same values stream in half the bytes: the
products compute the same numbers as float32 weights, rounded apart only by the order of
their sums. A weight that some value would change in 16 bits is never held so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lossless_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """float16 or bfloat16 if every value of the float32 `weight` is one exactly, else None."""
    if weight.dtype != torch.float32:
        return None
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(weight.to(dtype).float(), weight):
            return dtype
    return None


def pack(weight: torch.Tensor, dtype: torch.dtype, panel: int) -> torch.Tensor:
    """[out, in] → [panels, in, panel] in `dtype`, the last panel padded with zeros: the
    layout half_linear streams, each panel front to back."""
    out, inner = weight.shape
    padded = F.pad(weight.to(dtype), (0, 0, 0, (-out) % panel))
    return padded.view(-1, panel, inner).transpose(1, 2).contiguous()


def pack_int8(q: torch.Tensor, scale: torch.Tensor, panel: int) -> torch.Tensor:
    """int8 [out, in] values and float32 [out] scales → [panels, in + 4, panel] int8: each
    panel's values as `pack` lays them out, then its columns' scales as float32 bytes in four
    more rows, so that one tensor carries all the kernel reads (padded columns: value 0,
    scale 1)."""
    out, inner = q.shape
    pad = (-out) % panel
    values = F.pad(q, (0, 0, 0, pad)).view(-1, panel, inner).transpose(1, 2)  # [panels, in, panel]
    scales = F.pad(scale.float(), (0, pad), value=1.0).view(-1, panel)
    scale_rows = scales.view(torch.int8).view(-1, 4, panel)  # the panel's scales' bytes, in order
    return torch.cat([values, scale_rows], dim=1).contiguous()


DOT_PANEL = 64  # the dot-product kernel's panel width (specdec/native/int8_dot.cpp)


def pack_int8_dot(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] values and float32 [out] scales → uint8 [panels, in4 + 8, 64], the layout
    of specdec/native/int8_dot.cpp: per panel, four consecutive inputs of a column in each
    int32 lane (in4 = in rounded up to 4, zero-padded), then 128 · each column's sum as int32
    (the correction for the activations' + 128), then the columns' scales as float32."""
    out, inner = q.shape
    in4 = -(-inner // 4) * 4
    qp = F.pad(q, (0, in4 - inner, 0, (-out) % DOT_PANEL))  # [padded out, in4]
    panels = qp.shape[0] // DOT_PANEL
    values = qp.view(panels, DOT_PANEL, in4 // 4, 4).permute(0, 2, 1, 3).reshape(panels, in4, DOT_PANEL)
    csum = (qp.sum(dim=1, dtype=torch.int32) * 128).view(panels, DOT_PANEL)
    scales = F.pad(scale.float(), (0, qp.shape[0] - out), value=1.0).view(panels, DOT_PANEL)
    tail = [t.contiguous().view(torch.int8).view(panels, 4, DOT_PANEL) for t in (csum, scales)]
    return torch.cat([values] + tail, dim=1).contiguous().view(torch.uint8)
