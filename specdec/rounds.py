"""Bookkeeping of one speculation round, shared by the in-process loop and the
orchestrator: what each replica's cache holds, and what the next call must feed.

Convention: a cache holds committed[0:len] with len < len(committed), so every call
feeds at least the newest committed token (whose logits the next step needs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.cache_ref import CacheRef


@dataclass
class Cursor:
    draft_len: int = 0
    target_len: int = 0
    target_resync: bool = False  # the target holds more than target_len: roll back next call


@dataclass(frozen=True)
class Ends:
    """The tokens that end an answer: the model's end-of-sequence tokens (none where the
    request ignores them; a chat model often has several, its end of turn among them:
    specdec.model_files.end_token_ids) and the request's stop token ids. Each is kept in the
    answer, as EOS always was."""
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    stop_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def tokens(self) -> frozenset[int]:
        """Every token that ends the answer (what min_tokens holds off)."""
        return self.stop_ids | self.eos_ids

    def reason(self, token: int) -> str | None:
        """→ "eos" or "stop" where `token` ends the answer, else None."""
        if token in self.eos_ids:
            return "eos"
        return "stop" if token in self.stop_ids else None

    def cut(self, new: list[int]) -> tuple[list[int], str | None]:
        """A round's new tokens up to and with the first that ends the answer → (them, its reason)."""
        for i, token in enumerate(new):
            reason = self.reason(token)
            if reason is not None:
                return new[: i + 1], reason
        return new, None


def plan_gamma(gamma: int, remaining: int, committed_len: int, max_len: int) -> int:
    """Never draft past the token budget or the context: a round yields ≤ γ + 1 tokens."""
    return max(0, min(gamma, remaining - 1, max_len - committed_len - 1))


def chunk_calls(lacking: int, chunk: int) -> int:
    """The calls of their own that feeding `lacking` tokens `chunk` at a time makes before
    the last call, which feeds the rest with its own work (0 where `chunk` is 0: no limit)."""
    return (lacking - 1) // chunk if chunk and lacking > 0 else 0


def draft_ref(session_id: str, epoch: int, committed: list[int], cur: Cursor) -> CacheRef:
    return CacheRef(session_id, epoch, cur.draft_len, committed[cur.draft_len:])


def target_ref(session_id: str, epoch: int, committed: list[int], cur: Cursor) -> CacheRef:
    return CacheRef(session_id, epoch, cur.target_len, committed[cur.target_len:], cur.target_resync)


def new_tokens(draft_tokens: list[int], accepted: int, next_token: int) -> list[int]:
    return list(draft_tokens[:accepted]) + [next_token]


def advance(cur: Cursor, m: int, gamma: int, accepted: int, target_len: int, kept: int) -> Cursor:
    """Cursor after a round that started with m committed tokens, drafted γ, accepted n,
    and kept `kept` of its n + 1 new tokens (fewer when a stop condition cut it)."""
    draft_len = m + min(accepted, gamma - 1) if gamma > 0 else cur.draft_len
    limit = m + kept - 1  # stay below the new committed length
    return Cursor(draft_len=min(draft_len, limit), target_len=min(target_len, limit),
                  target_resync=target_len > limit)
