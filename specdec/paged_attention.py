"""Attention for a batch of sessions over paged caches (specdec.paged_cache), a few calls
per layer whatever the batch: one index_copy_ writes every session's new keys and values
into the pool; sessions of like lengths attend together, one gather of their keys and
values and one SDPA call per group, padded to the group's longest and masked.

Why: attention per session costs a cache write and an SDPA call per session and layer,
each a kernel launch with its Python and dispatch (several µs on a GPU's host, where the
forward of a small batch takes about as long as streaming the weights once). The plan is
built once per forward, the layers reuse it.

Grouping bounds the padding: sessions are taken in order of length and a group closes
before its padded keys would exceed PADDING × the keys its sessions need; a prefill (more
than `band` new tokens) attends alone, not padding every other session's queries to its
length. Padded query rows repeat a session's last row and padded keys read the pool's
null block (zeros, paged_cache.NULL), masked: no row is all −inf, so none is NaN; their
outputs are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F

from specdec.paged_cache import BLOCK, NULL, PagedKVCache

PADDING = 2.0  # keys attended ÷ keys needed a group may reach


@dataclass
class Group:
    read: torch.Tensor  # [g, K] pool slot of each key position (padding: the null block's first)
    rows: torch.Tensor  # [g, n] packed query row of each query position (padding: the last real row)
    mask: torch.Tensor  # [g, 1, n, K] or folded [g, 1, (H ÷ KV) · n, K], additive
    keep: torch.Tensor | None  # rows of the flattened [g · n] output that are real queries; None: all


@dataclass
class Plan:
    write: torch.Tensor  # [N] pool slot of each packed row's new key and value
    groups: list[Group]
    order: torch.Tensor | None  # packed row → row of the groups' concatenated outputs; None: the same


def groups_of(starts: list[int], lengths: list[int], band: int) -> list[list[int]]:
    """Sessions (indices) attended together: prefills alone, the rest by ascending key count,
    a group closed before its padded keys pass PADDING × those needed."""
    ends = [s + n for s, n in zip(starts, lengths)]
    out, cur, needed = [], [], 0
    for b in sorted(range(len(starts)), key=lambda b: (lengths[b] > band, ends[b])):
        if lengths[b] > band:
            out.append([b])
            continue
        if cur and (len(cur) + 1) * ends[b] > PADDING * (needed + ends[b]):
            out.append(cur)
            cur, needed = [], 0
        cur.append(b)
        needed += ends[b]
    if cur:
        out.append(cur)
    return out


def plan(caches: list[PagedKVCache], starts: list[int], lengths: list[int], band: int, fold: int,
         dtype: torch.dtype, device: torch.device) -> Plan:
    """The indices and masks of one forward: `fold` is H ÷ KV where a GPU's layout folds
    each kv head's query heads into rows (model_runner.grouped_attention), else 1."""
    offsets = list(accumulate([0] + lengths))
    write = np.concatenate([c.slots(s, s + n) for c, s, n in zip(caches, starts, lengths)])
    groups, sequence = [], []
    for members in groups_of(starts, lengths, band):
        groups.append(_group(members, caches, starts, lengths, offsets, fold, dtype, device))
        sequence += members
    order = None
    if sequence != list(range(len(caches))):
        rows = np.concatenate([np.arange(offsets[b], offsets[b + 1]) for b in sequence])
        order = torch.from_numpy(np.argsort(rows)).to(device)
    return Plan(torch.from_numpy(write).to(device), groups, order)


def _group(members: list[int], caches, starts, lengths, offsets, fold: int, dtype, device) -> Group:
    g = len(members)
    st = np.array([starts[b] for b in members])
    ln = np.array([lengths[b] for b in members])
    n = int(ln.max())
    K = -(-int((st + ln).max()) // 8) * 8  # the mask's rows start 16-byte aligned (aligned_mask)
    read = np.full((g, K), NULL * BLOCK, dtype=np.int64)
    for r, b in enumerate(members):
        read[r, : starts[b] + lengths[b]] = caches[b].slots(0, starts[b] + lengths[b])
    i = np.minimum(np.arange(n)[None, :], ln[:, None] - 1)  # padded queries repeat the last
    rows = np.array([offsets[b] for b in members])[:, None] + i
    seen = torch.from_numpy(np.arange(K)[None, None, :] <= (st[:, None] + i)[:, :, None])  # [g, n, K]
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
    mask = mask[:, None].expand(g, fold, n, K).reshape(g, 1, fold * n, K)
    keep = None
    if (ln < n).any():
        keep = torch.from_numpy(np.concatenate([r * n + np.arange(m) for r, m in enumerate(ln)]))
    return Group(torch.from_numpy(read).to(device), torch.from_numpy(rows).to(device), mask.to(device),
                 None if keep is None else keep.to(device))


def attend(pool: torch.Tensor, qkv: torch.Tensor, heads: int, kv_heads: int, p: Plan, scale: float,
           fold: bool) -> torch.Tensor:
    """One layer: `pool` [slots, 2 × KV, D] (the layer's view of BlockPool.kv), `qkv` [N, H + 2
    KV, D] the packed rows' rotated queries, keys and values → [N, H × D] attention outputs."""
    H, KV, D = heads, kv_heads, qkv.shape[-1]
    pool.index_copy_(0, p.write, qkv[:, H:])
    q = qkv[:, :H]
    outs = []
    for grp in p.groups:
        g, n = grp.rows.shape
        kv = pool.index_select(0, grp.read.view(-1)).view(g, -1, 2 * KV, D)  # [g, K, 2 KV, D]
        keys, values = kv[:, :, :KV].transpose(1, 2), kv[:, :, KV:].transpose(1, 2)  # [g, KV, K, D]
        qg = q[grp.rows].transpose(1, 2)  # [g, H, n, D]
        if fold and H != KV:
            out = F.scaled_dot_product_attention(qg.reshape(g, KV, (H // KV) * n, D), keys, values,
                                                 attn_mask=grp.mask, scale=scale).view(g, H, n, D)
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=grp.mask, scale=scale,
                                                 enable_gqa=H != KV)
        out = out.transpose(1, 2).reshape(g * n, H * D)
        outs.append(out if grp.keep is None else out[grp.keep])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if p.order is None else out[p.order]
