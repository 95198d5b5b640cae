"""A generation's counts and times, round by round (acceptance, drafted and kept tokens,
draft and verify time). Torch-free: the orchestrator's generations keep them as the
in-process loop (specdec/spec_loop.py) does.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoopStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    rejections: int = 0  # rounds that ended at a rejected draft token
    gamma_sum: int = 0
    accepted_per_round: list[int] = field(default_factory=list)

    def observe(self, gamma: int, accepted: int) -> None:
        """One round: γ drafted, `accepted` of them kept, one target pass."""
        self.rounds += 1
        self.target_passes += 1
        self.drafted += gamma
        self.accepted += accepted
        self.rejections += int(accepted < gamma)
        self.gamma_sum += gamma
        self.accepted_per_round.append(accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0
