"""A draft's [γ, V] distributions kept as they arrived, fp16 values beside each row's sum,
for a target whose verdicts run on a GPU.

The verdicts read a draft's law at its own tokens (γ values) and in whole rows only where a
stop test or the next token needs them (specdec/sampling.py); decoding every row to float64
on the host (specdec.wire.decode) wrote 8 bytes a value that then crossed to the device. Here
the values stay fp16 (2 bytes a value) and are divided by their row's float64 sum where read,
on the device for a row: an fp16 value widens to float64 exactly, and one IEEE division
rounds alike on any device, so each probability has the bits decode gives it
(tests/specdec/test_draft_rows.py). The sums are taken on the host in sampling.lane_sums'
fixed order, as the draft's sampler weighs its rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftRows:
    values: torch.Tensor  # [γ, V] float16 on the host, as they came over the wire
    sums: torch.Tensor  # [γ] float64: each row's sum in sampling.lane_sums' order

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def at(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens)] float64 on the host: row i's probability of tokens[i] (each step's
        drafted token)."""
        steps = torch.arange(len(tokens))
        return self.values[steps, torch.tensor(tokens, dtype=torch.long)].double() / self.sums[:len(tokens)]

    def row(self, i: int) -> torch.Tensor:
        """Row i as decode gives it: [V] float64 on the host."""
        return self.values[i].double() / self.sums[i]


Law = torch.Tensor | DraftRows  # a VerifyJob's q: decoded rows, or rows kept fp16


def law_at(q: Law, tokens: list[int]) -> torch.Tensor:
    """[len(tokens)] float64 on the host: q's row i at tokens[i]."""
    if isinstance(q, DraftRows):
        return q.at(tokens)
    return q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].cpu()


def law_rows(picks: list[tuple[Law, int] | None], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(picks)] rows, [k, V] float64 on `device`: row i of each picked law, zeros for
    None (a bonus after a whole draft kept: no q). Rows kept fp16 cross in fp16 with their
    sums and are divided there; any other law's rows are stacked where they are and cross
    once (a copy a row cost a GPU a synchronous transfer each)."""
    if picks and all(p is None or isinstance(p[0], DraftRows) for p in picks):
        zero = torch.zeros(vocab, dtype=torch.float16)
        values = torch.stack([zero if p is None else p[0].values[p[1]] for p in picks])
        sums = torch.tensor([1.0 if p is None else float(p[0].sums[p[1]]) for p in picks], dtype=torch.float64)
        return values.to(device).double().div_(sums.to(device)[:, None])
    rows = [None if p is None else (p[0].row(p[1]) if isinstance(p[0], DraftRows) else p[0][p[1]]) for p in picks]
    home = next((r.device for r in rows if r is not None), device)
    zero = torch.zeros(vocab, dtype=torch.float64, device=home)
    return torch.stack([zero if r is None else r.to(home) for r in rows]).to(device)
