"""Int8 weights for a draft model: its decode step streams half the bytes of 16-bit weights.

A draft step on a CPU costs about what streaming its weights costs (the bundled 1-layer
draft: 3.8 MB in 16 bits, most of it the tied 4,096 × 256 LM head), and that is the draft's
side of the cost ratio c that caps speculation's gain. Quantising the draft changes only
the proposals: the target accepts or corrects every drafted token against the distribution
the draft actually drew it from, so the output law stays the target's exactly, and a weaker
draft only lowers α. The target is never quantised here, since its law is the output's.

Each output row of a weight gets one scale (symmetric, the row's largest magnitude ↦ 127),
and the served model is those int8 values times their scales: the runner writes the
dequantised values back into the model's weights, in place, so that every kernel (aten,
oneDNN or the native int8 panels of specdec/native/half_linear.cpp) and every module
sharing a weight (a tied embedding) computes the same quantised model, to float rounding.
"""
from __future__ import annotations

import torch

MODES = ("none", "int8")
CHOICES = ("auto",) + MODES  # a draft replica's --quantize


def resolve(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """A draft's --quantize → "int8" or "none". "auto" is int8 where it pays and costs
    nothing measurable: a float32 model on a CPU whose native kernels built (the int8
    panels halve the bytes a step streams; on the bundled draft the held-out α was the
    same, 0.7237 both). On a GPU the weights would only lose precision: none."""
    if mode not in CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(CHOICES)}, not {mode!r}")
    if mode != "auto":
        return mode
    from specdec import native

    return "int8" if device.type == "cpu" and dtype == torch.float32 and native.module() is not None else "none"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight → (int8 values [out, in], float32 scales [out]): weight ≈ q · scale
    per row. A row of zeros gets scale 1 (its values are all 0 either way)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight the quantised values stand for, as every kernel must compute it."""
    return q.float() * scale[:, None]


def quantize_linears_(model: torch.nn.Module) -> dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Every nn.Linear weight of `model` replaced in place by its dequantised int8 values (a
    tied embedding follows its LM head) → each linear's (values, scales). Done once per model:
    a second call returns the first call's factors, since quantising dequantised values
    again may move a scale by a rounding."""
    done = getattr(model, "_specdec_int8", None)
    if done is not None:
        return done
    factors = {}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_rows(module.weight)
                module.weight.copy_(dequantize(q, scale).to(module.weight.dtype))
                factors[module] = (q, scale)
    model._specdec_int8 = factors
    return factors
