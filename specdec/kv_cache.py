"""A per-session KV cache written by position.

Like gpt-fast's static cache, rollback after a rejection copies nothing: `truncate`
moves the length back and the next write overwrites the rejected slots. The buffer
grows by doubling, so a session costs memory in proportion to its length.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device, capacity: int = 128, max_length: int = 2048) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_length = max_length
        self.length = 0
        cap = min(capacity, max_length)
        self.keys = torch.empty(layers, kv_heads, cap, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by this session's buffers (allocated, not only used)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def reserve(self, length: int) -> None:
        """Make room for `length` positions (doubling), keeping what is stored."""
        if length > self.max_length:
            raise ValueError(f"sequence of {length} tokens exceeds the model context of {self.max_length}")
        if length <= self.capacity:
            return
        cap = self.capacity
        while cap < length:
            cap *= 2
        cap = min(cap, self.max_length)
        layers, heads, dim = self.shape
        keys = torch.empty(layers, heads, cap, dim, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def truncate(self, length: int) -> None:
        """Roll back to `length` positions; nothing is copied."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values: [kv_heads, n, head_dim] for positions start .. start+n-1."""
        n = keys.shape[1]
        self.keys[layer, :, start : start + n] = keys
        self.values[layer, :, start : start + n] = values

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, end, head_dim] views of positions 0 .. end-1 (no copy)."""
        return self.keys[layer, :, :end], self.values[layer, :, :end]
