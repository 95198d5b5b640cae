"""Pearson's chi-square goodness-of-fit test for the statistical tests, on torch alone.

Its p-value is the chi-square law's upper tail, the regularised upper incomplete gamma
function Q(df / 2, stat / 2), which torch ships. The tests needed nothing else from SciPy,
and with SciPy installed every replica a test starts paid for importing it: transformers
imports scipy.optimize wherever it can (about half a second a process here), which the
served image, without SciPy, never does."""
from __future__ import annotations

import torch


def chisquare_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P(X ≥ stat) for X ~ χ²(k − 1), stat = Σ (observed − expected)² / expected over the k
    bins. `expected` must sum to `observed`'s total, as SciPy's `chisquare` requires."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    if observed.numel() != expected.numel() or observed.numel() < 2:
        raise ValueError(f"need two or more bins of each, got {observed.numel()} and {expected.numel()}")
    if not torch.isclose(observed.sum(), expected.sum(), rtol=1e-8):
        raise ValueError(f"observed total {observed.sum().item()} != expected total {expected.sum().item()}")
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(observed.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))
