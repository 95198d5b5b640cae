"""The KV cache's growth: room in whole blocks, half as much again on a decode's small
steps, a quarter more than a prefill needs, never past the model's context, and what was
stored kept across a growth."""
from __future__ import annotations

import pytest
import torch

from specdec.kv_cache import BLOCK, KVCache, grown_capacity


def test_a_decode_grows_by_half_and_a_prefill_to_a_quarter_more_in_whole_blocks():
    assert grown_capacity(128, 129, 2048) == 192  # a decode's step past 128: half as much again
    assert grown_capacity(128, 1000, 2048) == 1280  # a 1,000-token prefill: 1,250 rounded up to blocks
    assert grown_capacity(1280, 1281, 2048) == 1920
    assert grown_capacity(1920, 1921, 2048) == 2048  # the context caps it
    for cap, length in ((128, 129), (192, 700), (64, 65), (1344, 1400)):
        grown = grown_capacity(cap, length, 4096)
        assert grown % BLOCK == 0 and grown >= max(length, cap * 3 // 2)
    # a 1,000-token prompt and its 64-token answer, decoded 4 positions a round: one growth
    steps, cap = 0, 128
    for length in [1000, *range(1004, 1065, 4)]:
        if length > cap:
            cap, steps = grown_capacity(cap, length, 2048), steps + 1
    assert (cap, steps) == (1280, 1)  # doubling left it at 2,048 after two


def test_a_cache_keeps_what_it_stored_as_it_grows_and_refuses_past_its_context():
    cache = KVCache(2, 1, 4, dtype=torch.float32, device=torch.device("cpu"), capacity=64, max_length=200)
    kv = torch.arange(2 * 10 * 4, dtype=torch.float32).reshape(2, 10, 4)
    cache.write_ids(0, list(range(10)))
    cache.write(1, 0, kv)
    cache.length = 10
    cache.write_ids(10, list(range(100)))  # to 110 positions
    assert cache.capacity == 192 and cache.length == 10
    assert torch.equal(cache.kv[1, :, :10], kv) and list(cache.ids[:10]) == list(range(10))
    cache.reserve(193)
    assert cache.capacity == 200
    with pytest.raises(ValueError, match="exceeds the model context of 200"):
        cache.reserve(201)


def test_growth_bytes_is_what_a_reserve_adds():
    cache = KVCache(3, 2, 8, dtype=torch.float32, device=torch.device("cpu"), capacity=64, max_length=300)
    for length in (10, 64, 65, 140, 299, 300):
        before, promised = cache.nbytes, cache.growth_bytes(length)
        cache.reserve(length)
        assert cache.nbytes - before == promised, length
    assert cache.growth_bytes(300) == 0
