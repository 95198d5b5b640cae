"""Int8 weights for a draft model: its decode step streams half the bytes of 16-bit weights.

A draft step on a CPU costs about what streaming its weights costs (the bundled 1-layer
draft: 3.8 MB in 16 bits, most of it the tied 4,096 × 256 LM head), and that is the draft's
side of the cost ratio c that caps speculation's gain. Quantising the draft changes only
the proposals: the target accepts or corrects every drafted token against the distribution
the draft actually drew it from, so the output law stays the target's exactly, and a weaker
draft only lowers α. The target is never quantised here, since its law is the output's.

"w8a8" serves the same int8 weights and, in the compact kernel (a decode step's and a
verification's few rows), also rounds each row of a product's input to 8 bits with one
scale per row, so that the product runs as exact integer dot products (AVX-512 VNNI:
specdec/native/int8_dot.cpp): at one row the LM head's product took 15 µs against 40 µs
widening int8 weights. `quantize_activations` is that rounding in torch.

Each output row of a weight gets one scale (symmetric, the row's largest magnitude ↦ 127),
and the served model is those int8 values times their scales: the runner writes the
dequantised values back into the model's weights, in place, so that every kernel (aten,
oneDNN or the native int8 panels of specdec/native/half_linear.cpp) and every module
sharing a weight (a tied embedding) computes the same quantised model, to float rounding.
"""
from __future__ import annotations

import torch

MODES = ("none", "int8", "w8a8")
CHOICES = ("auto",) + MODES  # a draft replica's --quantize


def resolve(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """A draft's --quantize → "w8a8", "int8" or "none". "auto" quantises where it pays and
    costs nothing measurable, on a float32 model on a CPU whose native kernels built: "w8a8"
    (int8 weights and, in the compact kernel, int8 activations too, multiplied by the CPU's
    8-bit dot products) where the CPU has them (AVX-512 VNNI), else "int8" (weights only,
    widened in the kernel: half the bytes a step streams). On the bundled draft the held-out
    α was the same for all three (0.7237, 0.7237, 0.7236). On a GPU the weights would only
    lose precision: none."""
    if mode not in CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(CHOICES)}, not {mode!r}")
    if mode == "int8" and device.type != "cpu":
        raise ValueError(f"int8 weights are a CPU's option (its native kernel streams them); on {device.type} "
                         "they would only cost the draft precision, and memory for the int8 copies: use none")
    if mode != "auto":
        return mode
    from specdec import native

    if device.type != "cpu" or dtype != torch.float32 or native.module() is None:
        return "none"
    return "w8a8" if native.module().has_int8_dot() else "int8"


def w8a8_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why "w8a8" cannot be served here, or None: its products are specdec.native's 8-bit dot
    products, float32 on a CPU with AVX-512 VNNI (elsewhere their plain loop would be slow)."""
    from specdec import native

    if device.type != "cpu" or dtype != torch.float32:
        return f"it serves float32 models on a CPU, not {device.type} {dtype}"
    if native.module() is None:
        return f"the native kernels did not build: {native.unavailable_reason()}"
    if not native.module().has_int8_dot():
        return f"this CPU has no 8-bit dot products (AVX-512 VNNI; instruction set in use: {native.module().isa()})"
    return None


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


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the "w8a8" kernel makes of a product's input, in torch (its reference, and the
    emulation a probe runs through Hugging Face's forward): each row rounded to 8 bits,
    symmetric, with one scale per row (a row of zeros keeps scale 1)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.clamp(torch.round(x / s), -127, 127) * s


def round_linear_inputs_(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every nn.Linear's input rounded as the w8a8 kernel rounds its rows (a
    forward pre-hook each): with `quantize_linears_` first, torch's emulation of the model a
    w8a8 runner serves at a decode step, for a probe or a test to run anywhere."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (quantize_activations(args[0]),) + tuple(args[1:]))
    return model
