"""The tests' chi-square p-value (tests/stats.py) against closed forms of the law's tail."""
import math

import pytest
import torch

from tests.stats import chisquare_pvalue


def _with_stat(stat: float, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed and expected counts over `bins` bins whose statistic is `stat`: 100 expected
    in each, the first two bins off by ±d, so that stat = 2 d² / 100."""
    d = math.sqrt(stat * 50)
    expected = torch.full((bins,), 100.0, dtype=torch.float64)
    observed = expected.clone()
    observed[0] += d
    observed[1] -= d
    return observed, expected


@pytest.mark.parametrize("stat", [0.0, 0.5, 3.0, 9.21, 30.0])
def test_the_tail_matches_its_closed_forms(stat):
    # χ²(2): exp(−x/2); χ²(4): exp(−x/2)(1 + x/2); χ²(1): erfc(√(x/2))
    assert chisquare_pvalue(*_with_stat(stat, 3)) == pytest.approx(math.exp(-stat / 2), rel=1e-10, abs=1e-300)
    assert chisquare_pvalue(*_with_stat(stat, 5)) == pytest.approx(math.exp(-stat / 2) * (1 + stat / 2), rel=1e-10)
    assert chisquare_pvalue(*_with_stat(stat, 2)) == pytest.approx(math.erfc(math.sqrt(stat / 2)), rel=1e-10)


def test_a_law_that_is_not_the_observed_ones_gets_a_tiny_p_value():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    counts = torch.multinomial(p, 20000, replacement=True, generator=gen).bincount(minlength=3).double()
    assert chisquare_pvalue(counts, p * counts.sum()) > 1e-3
    wrong = torch.tensor([0.45, 0.35, 0.2], dtype=torch.float64)
    assert chisquare_pvalue(counts, wrong * counts.sum()) < 1e-6


def test_mismatched_counts_are_refused():
    with pytest.raises(ValueError, match="total"):
        chisquare_pvalue(torch.tensor([5.0, 5.0]), torch.tensor([4.0, 4.0]))
    with pytest.raises(ValueError, match="two or more bins"):
        chisquare_pvalue(torch.tensor([5.0]), torch.tensor([5.0]))
