"""A paged KV cache: every session's keys and values in fixed-size blocks of one pool.

Why, beside `kv_cache.KVCache` (one buffer per session): a forward over a batch of sessions
then writes all their new keys and values with one indexed copy per layer, and attends for
sessions of like lengths with one gather and one SDPA call per layer (ModelRunner's
`paged` attention), where per-session buffers take a write and an SDPA call per session
and layer: 2 × 16 × 32 = 1,024 kernel launches in a forward of 16 sessions through a
32-layer model, each with its Python and dispatch, which on a GPU cost more than the
forward's arithmetic. And a fork shares the blocks it copies whole (a shared system
prompt, a pre-draft's branch) instead of copying them: copy-on-write, by reference counts.

The pool is [layers, blocks × BLOCK, 2 × kv_heads, head_dim]: a position's keys and values
side by side, as the fused q/k/v projection produces them, so the write is one index_copy_
of the projection's rows. It grows by half again when it runs out (a copy of what it holds,
rare: it never shrinks, freed blocks are reused), or is sized once (`BlockPool.reserve`).
Block 0 is never handed out: it stays zeros, and the padding slots a batched attention
gathers (masked out) read it, so no session's attention reads another's keys even masked
(a non-finite key there would turn a masked score into NaN).
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from specdec.kv_cache import RollbackIds

BLOCK = 16  # positions per block
NULL = 0  # the block no cache holds: padding reads its zeros


class BlockPool:
    """The blocks of one model's caches and their reference counts. Allocation happens on
    the engine's thread; a cache's blocks come back when it is collected, on any thread,
    hence the lock (re-entrant: a collection may run inside an allocation)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device, blocks: int = 64) -> None:
        if blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks, got {blocks}")
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self._fresh(blocks)
        self._lock = threading.RLock()
        self.block_bytes = layers * BLOCK * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def blocks(self) -> int:
        return len(self.refs)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds, its blocks in use or free."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def used(self) -> int:
        """Blocks held by at least one cache."""
        return self.blocks - len(self._free) - 1

    def reserve(self, blocks: int) -> None:
        """Hold `blocks` blocks from now on: exactly that many while no cache holds one (a
        replica's budget, known at start), else at least that many."""
        if blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks, got {blocks}")
        with self._lock:
            if self.used == 0 and blocks != self.blocks:
                self.kv = None  # the old one's memory free before the new one's is taken
                self._fresh(blocks)
            elif blocks > self.blocks:
                self._grow(blocks)

    def allocate(self, n: int) -> np.ndarray:
        """n free blocks, each with one reference."""
        with self._lock:
            if n > len(self._free):
                self._grow(max(self.blocks + n - len(self._free), self.blocks + self.blocks // 2))
            out = np.array([self._free.pop() for _ in range(n)], dtype=np.int64)
            self.refs[out] = 1
            return out

    def share(self, blocks: np.ndarray) -> None:
        with self._lock:
            self.refs[blocks] += 1

    def release(self, blocks: np.ndarray) -> None:
        with self._lock:
            self.refs[blocks] -= 1
            self._free.extend(int(b) for b in blocks[self.refs[blocks] == 0])

    def copy(self, src: int, dst: int, positions: int = BLOCK) -> None:
        """The first `positions` slots of block src into block dst, every layer."""
        self.kv[:, dst * BLOCK : dst * BLOCK + positions] = self.kv[:, src * BLOCK : src * BLOCK + positions]

    def _zeros(self, blocks: int) -> torch.Tensor:
        layers, heads, dim = self.shape
        return torch.zeros(layers, blocks * BLOCK, 2 * heads, dim, dtype=self.dtype, device=self.device)

    def _fresh(self, blocks: int) -> None:
        """`blocks` zeroed blocks, none held but the null one."""
        self.kv = self._zeros(blocks)
        self.refs = np.zeros(blocks, dtype=np.int32)
        self.refs[NULL] = 1  # held for good
        self._free = list(range(blocks - 1, NULL, -1))  # popped from the end: low blocks first

    def _grow(self, blocks: int) -> None:
        kv = self._zeros(blocks)
        kv[:, : self.kv.shape[1]] = self.kv
        old = self.blocks
        self.kv = kv
        self.refs = np.concatenate([self.refs, np.zeros(blocks - old, dtype=np.int32)])
        self._free[:0] = range(blocks - 1, old - 1, -1)  # after the free low blocks


class PagedKVCache(RollbackIds):
    """One session's positions as a table of the pool's blocks; `kv_cache.KVCache`'s
    interface (length, ids, reserve, fork, truncate, write_ids, write, view, nbytes,
    growth_bytes) so that the session table and engines hold either. A rollback keeps its
    blocks held."""

    def __init__(self, pool: BlockPool, max_length: int) -> None:
        self.pool = pool
        self.shape = pool.shape
        self.dtype, self.device = pool.dtype, pool.device
        self.max_length = max_length
        self.length = 0
        self.table = np.zeros(0, dtype=np.int64)  # block of each BLOCK positions
        self.ids = np.zeros(0, dtype=np.int64)

    def __del__(self) -> None:
        try:
            if len(self.table):
                self.pool.release(self.table)
                self.table = self.table[:0]
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass

    @property
    def capacity(self) -> int:
        return len(self.table) * BLOCK

    @property
    def nbytes(self) -> int:
        """This cache's share of its blocks' bytes: a block held by k caches counts 1/k in
        each, so that the session table's sum is what the pool holds for them."""
        if not len(self.table):
            return 0
        return int(round(self.pool.block_bytes * float(np.sum(1.0 / self.pool.refs[self.table]))))

    def growth_bytes(self, length: int) -> int:
        """Bytes `reserve(length)` would take from the pool: new blocks and shared blocks it
        must copy before writing to them."""
        need = -(-min(length, self.max_length) // BLOCK)
        first = self.length // BLOCK
        shared = int(np.count_nonzero(self.pool.refs[self.table[first:need]] > 1))
        return (max(0, need - len(self.table)) + shared) * self.pool.block_bytes

    def reserve(self, length: int) -> None:
        """Room for `length` positions, the blocks that positions `self.length` .. length-1
        fall in made this cache's own (copied where a fork shares them): a forward writes
        from the cache's current length on."""
        if length > self.max_length:
            raise ValueError(f"sequence of {length} tokens exceeds the model context of {self.max_length}")
        need = -(-length // BLOCK)
        if need > len(self.table):
            self.table = np.concatenate([self.table, self.pool.allocate(need - len(self.table))])
            ids = np.zeros(need * BLOCK, dtype=np.int64)
            ids[: len(self.ids)] = self.ids
            self.ids = ids
        first = self.length // BLOCK
        for k in np.nonzero(self.pool.refs[self.table[first:need]] > 1)[0] + first:
            own = int(self.pool.allocate(1)[0])
            self.pool.copy(int(self.table[k]), own)
            self.pool.release(self.table[k : k + 1])
            self.table[k] = own

    def fork(self, length: int, capacity: int) -> "PagedKVCache":
        """A new cache of positions 0 .. length-1: the whole blocks shared, the last partial
        one copied (`capacity`, the contiguous cache's room, is allocated as it is written)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot fork {length} positions of a cache of {self.length}")
        new = PagedKVCache(self.pool, self.max_length)
        whole, rest = divmod(length, BLOCK)
        shared = self.table[:whole].copy()
        self.pool.share(shared)
        if rest:
            own = self.pool.allocate(1)
            self.pool.copy(int(self.table[whole]), int(own[0]), rest)
            shared = np.concatenate([shared, own])
        new.table = shared
        new.ids = np.zeros(len(shared) * BLOCK, dtype=np.int64)
        new.ids[:length] = self.ids[:length]
        new.length = length
        return new

    def slots(self, start: int, end: int) -> np.ndarray:
        """The pool slots of positions start .. end-1."""
        pos = np.arange(start, end)
        return self.table[pos // BLOCK] * BLOCK + pos % BLOCK

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """kv: [2 × kv_heads, n, head_dim], keys then values, for positions start .. start+n-1
        (KVCache's layout: a forward over paged caches writes the pool itself)."""
        slots = torch.from_numpy(self.slots(start, start + kv.shape[1])).to(self.device)
        self.pool.kv[layer].index_copy_(0, slots, kv.transpose(0, 1))

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, end, head_dim] keys and values of positions 0 .. end-1 (gathered: a copy)."""
        heads = self.shape[1]
        kv = self.pool.kv[layer][torch.from_numpy(self.slots(0, end)).to(self.device)].transpose(0, 1)
        return kv[:heads], kv[heads:]
