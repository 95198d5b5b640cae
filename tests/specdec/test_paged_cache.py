"""Paged caches (specdec.paged_cache) against the contiguous KVCache, operation by operation,
and the pool's blocks: shared by forks, copied before a write, given back when collected."""
import gc
import random
import threading

import numpy as np
import pytest
import torch

from specdec.kv_cache import KVCache
from specdec.paged_cache import BLOCK, NULL, BlockPool, PagedKVCache

LAYERS, HEADS, DIM, MAX = 2, 2, 4, 300


def pool(blocks: int = 4) -> BlockPool:
    return BlockPool(LAYERS, HEADS, DIM, dtype=torch.float32, device=torch.device("cpu"), blocks=blocks)


def feed(cache, n: int, gen: torch.Generator) -> None:
    """n new positions at the cache's length, every layer, as a forward writes them."""
    start = cache.length
    cache.reserve(start + n)
    cache.write_ids(start, torch.randint(0, 100, (n,), generator=gen).tolist())
    for layer in range(LAYERS):
        cache.write(layer, start, torch.randn(2 * HEADS, n, DIM, generator=gen))
    cache.length = start + n


def same(paged: PagedKVCache, plain: KVCache) -> bool:
    if paged.length != plain.length or not np.array_equal(paged.ids[: paged.length], plain.ids[: plain.length]):
        return False
    return all(torch.equal(a, b) for layer in range(LAYERS)
               for a, b in zip(paged.view(layer, paged.length), plain.view(layer, plain.length)))


def held_blocks(caches) -> int:
    return len({int(b) for c in caches for b in c.table})


def test_random_operations_keep_a_paged_cache_equal_to_a_contiguous_one():
    """Feeds, rollbacks and forks (of forks), the same on both layouts with the same numbers:
    every cache reads back what the contiguous one holds, the pool's reference counts are the
    caches' tables, and every block comes back once the caches are gone."""
    rng, p = random.Random(0), pool()
    pairs = [(PagedKVCache(p, MAX), KVCache(LAYERS, HEADS, DIM, dtype=torch.float32, device=torch.device("cpu"),
                                            capacity=8, max_length=MAX))]
    for step in range(300):
        i = rng.randrange(len(pairs))
        paged, plain = pairs[i]
        op = rng.random()
        if op < 0.5 and plain.length < MAX - 40:
            n = rng.choice([1, 3, 5, 17, 40])
            feed(paged, n, torch.Generator().manual_seed(step))
            feed(plain, n, torch.Generator().manual_seed(step))
        elif op < 0.75 and plain.length:
            keep = rng.randrange(plain.length + 1)
            paged.truncate(keep)
            plain.truncate(keep)
        elif op < 0.9 and plain.length:
            at = rng.randrange(plain.length + 1)
            pairs.append((paged.fork(at, at + 8), plain.fork(at, at + 8)))
        elif len(pairs) > 1:
            pairs.pop(i)
        for paged, plain in pairs:
            assert same(paged, plain), step
        refs = np.zeros(p.blocks, dtype=np.int32)
        refs[NULL] = 1  # never handed out
        for paged, _ in pairs:
            np.add.at(refs, paged.table, 1)
        assert np.array_equal(refs, p.refs), step
        assert p.used == held_blocks(c for c, _ in pairs), step
    del paged, plain
    pairs.clear()
    gc.collect()
    assert p.used == 0 and not p.refs[NULL + 1 :].any()


def test_a_fork_shares_whole_blocks_and_a_write_after_a_rollback_copies_them():
    p, gen = pool(), torch.Generator().manual_seed(1)
    a = PagedKVCache(p, MAX)
    feed(a, 2 * BLOCK + 5, gen)
    before = [t.clone() for t in a.view(0, a.length)]
    b = a.fork(2 * BLOCK + 3, 64)
    assert list(b.table[:2]) == list(a.table[:2]) and b.table[2] != a.table[2]  # the partial block copied
    assert list(p.refs[a.table]) == [2, 2, 1]
    b.truncate(BLOCK + 1)  # back into the second block, which both share
    assert b.growth_bytes(BLOCK + 4) == p.block_bytes  # the second block, shared, is copied first
    feed(b, 3, gen)
    assert b.table[1] != a.table[1] and b.table[0] == a.table[0]
    assert list(p.refs[a.table]) == [2, 1, 1]
    assert all(torch.equal(x, y) for x, y in zip(a.view(0, a.length), before))  # the original untouched


def test_bytes_count_shared_blocks_once_across_caches():
    p, gen = pool(), torch.Generator().manual_seed(2)
    a = PagedKVCache(p, MAX)
    feed(a, 3 * BLOCK, gen)
    forks = [a.fork(2 * BLOCK, 40) for _ in range(3)]
    assert a.nbytes + sum(f.nbytes for f in forks) == p.used * p.block_bytes == 3 * p.block_bytes
    assert a.nbytes == p.block_bytes * (1 + 2 / 4)
    assert forks[0].growth_bytes(2 * BLOCK + 1) == p.block_bytes  # a new block; the shared ones lie before it
    assert forks[0].growth_bytes(10) == 0


def test_the_pool_grows_keeping_what_it_holds_and_refuses_past_the_context():
    p, gen = pool(blocks=2), torch.Generator().manual_seed(3)
    a = PagedKVCache(p, MAX)
    feed(a, BLOCK + 2, gen)
    kept = [t.clone() for t in a.view(1, a.length)]
    b = PagedKVCache(p, MAX)
    feed(b, 5 * BLOCK, gen)
    assert p.blocks >= 8 and p.used == 7
    assert all(torch.equal(x, y) for x, y in zip(a.view(1, a.length), kept))
    with pytest.raises(ValueError, match="exceeds the model context of 300"):
        a.reserve(MAX + 1)
    p.reserve(40)
    assert p.blocks == 40 and p.used == 7
    p.reserve(30)  # blocks in use: it never shrinks
    assert p.blocks == 40
    fresh = pool(blocks=64)
    fresh.reserve(5)  # none in use: the size asked
    assert fresh.blocks == 5 and fresh.used == 0 and len(fresh.allocate(4)) == 4


def test_blocks_come_back_when_a_cache_is_collected_on_another_thread():
    p, gen = pool(), torch.Generator().manual_seed(4)
    caches = [PagedKVCache(p, MAX) for _ in range(4)]
    for cache in caches:
        feed(cache, 20, gen)
    del cache
    assert p.used == 8
    threading.Thread(target=caches.clear).start()
    for _ in range(100):
        if p.used == 0:
            break
        threading.Event().wait(0.01)
    assert p.used == 0
    assert sorted(p.allocate(8).tolist()) == list(range(1, 9))  # the freed blocks are reused, never the null one
    assert not p.kv[:, : BLOCK].any()
