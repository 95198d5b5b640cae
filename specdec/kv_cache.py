"""A per-session KV cache written by position.

Like gpt-fast's static cache, rollback after a rejection copies nothing: `truncate`
moves the length back and the next write overwrites the rejected slots. The buffer grows
by half again, or to a quarter more than a long write needs (a prompt's prefill), in
blocks of `BLOCK` positions (`grown_capacity`), so a session costs memory in proportion
to its length: doubling left a 1,000-token prompt's cache at 2,048 positions for the 64
tokens of its answer, and caches half empty on average (a soak's, 2026-12-07).

Keys and values of a layer share one buffer ([2 × kv_heads, capacity, head_dim]: keys,
then values), in the order the fused q/k/v projection produces them, so that a forward
writes a session's new keys and values with one copy per layer instead of two.

Beside them, the token id at each position (`ids`, a numpy array: written by whoever feeds
the cache with `write_ids`, in or out of torch's inference mode): what a repetition, presence
or frequency penalty counts.
"""
from __future__ import annotations

import numpy as np
import torch


BLOCK = 64  # positions: capacities are multiples of it


def grown_capacity(capacity: int, length: int, max_length: int) -> int:
    """The capacity a cache of `capacity` positions grows to when it must hold `length`:
    half as much again (so that a decode's small steps copy each position about twice in
    all), or a quarter more than `length` where that is more (a prefill is followed by an
    answer), rounded up to whole blocks, and never past the model's context."""
    want = max(capacity + capacity // 2, length + length // 4)
    return min(-(-want // BLOCK) * BLOCK, max_length)


class RollbackIds:
    """What both cache layouts do alike with `length`, `ids` and `reserve`: roll back by
    moving the length, record the ids of fed tokens."""

    length: int
    ids: np.ndarray

    def reserve(self, length: int) -> None:
        raise NotImplementedError

    def truncate(self, length: int) -> None:
        """Roll back to `length` positions; nothing is copied."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def write_ids(self, start: int, tokens: list[int]) -> None:
        """Record the ids of the tokens fed at positions start .. start+n-1."""
        self.reserve(start + len(tokens))
        self.ids[start : start + len(tokens)] = tokens


class KVCache(RollbackIds):
    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device, capacity: int = 128, max_length: int = 2048) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_length = max_length
        self.length = 0
        cap = min(capacity, max_length)
        self.kv = torch.empty(layers, 2 * kv_heads, cap, head_dim, dtype=dtype, device=device)
        self.ids = np.zeros(cap, dtype=np.int64)

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by this session's buffer (allocated, not only used)."""
        return self.kv.numel() * self.kv.element_size()

    def growth_bytes(self, length: int) -> int:
        """Bytes `reserve(length)` would add to this cache's buffer (0 where it has room)."""
        if length <= self.capacity:
            return 0
        cap = grown_capacity(self.capacity, min(length, self.max_length), self.max_length)
        return (cap - self.capacity) * (self.nbytes // self.capacity)

    def reserve(self, length: int) -> None:
        """Make room for `length` positions (`grown_capacity`), keeping what is stored."""
        if length > self.max_length:
            raise ValueError(f"sequence of {length} tokens exceeds the model context of {self.max_length}")
        if length <= self.capacity:
            return
        cap = grown_capacity(self.capacity, length, self.max_length)
        layers, heads, dim = self.shape
        kv = torch.empty(layers, 2 * heads, cap, dim, dtype=self.dtype, device=self.device)
        kv[:, :, : self.length] = self.kv[:, :, : self.length]
        self.kv = kv
        ids = np.zeros(cap, dtype=np.int64)
        ids[: self.length] = self.ids[: self.length]
        self.ids = ids

    def fork(self, length: int, capacity: int) -> "KVCache":
        """A new cache holding a copy of positions 0 .. length-1, with room for `capacity`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot fork {length} positions of a cache of {self.length}")
        layers, heads, dim = self.shape
        new = KVCache(layers, heads, dim, dtype=self.dtype, device=self.device,
                      capacity=max(capacity, length, 1), max_length=self.max_length)
        new.kv[:, :, :length] = self.kv[:, :, :length]
        new.ids[:length] = self.ids[:length]
        new.length = length
        return new

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """kv: [2 × kv_heads, n, head_dim], keys then values, for positions start .. start+n-1."""
        self.kv[layer, :, start : start + kv.shape[1]] = kv

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, end, head_dim] views of the keys and values of positions 0 .. end-1
        (no copy)."""
        heads = self.shape[1]
        return self.kv[layer, :heads, :end], self.kv[layer, heads:, :end]
