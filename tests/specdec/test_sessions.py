"""The per-replica session table: idle sessions released after a while."""
from __future__ import annotations

import time

import pytest

from specdec.model_runner import ModelRunner
from specdec.sessions import CacheRef, SessionTable


@pytest.fixture(scope="module")
def table(draft_model) -> SessionTable:
    return SessionTable(ModelRunner(draft_model, linear_kernels="aten"), max_sessions=8)


def test_sessions_idle_too_long_are_released_in_order_of_last_use(table):
    for sid in ("a", "b", "c"):
        table.acquire(CacheRef(sid, 1, 0, [1, 2]), exact=True)
    now = time.monotonic()
    for sid, idle in (("a", 30.0), ("b", 20.0), ("c", 5.0)):
        table._sessions[sid].last_used = now - idle
    table.acquire(CacheRef("a", 1, 0, [1, 2], resync=True), exact=True)  # used again: idle no more
    assert table.expire_idle(10.0, now=time.monotonic()) == 1  # b only
    assert "b" not in table and "a" in table and "c" in table and table.expired == 1
    assert table.expire_idle(10.0, now=time.monotonic() + 11.0) == 2
    assert len(table) == 0 and table.expired == 3
    assert table.expire_idle(10.0) == 0


def _fed(table: SessionTable, sid: str, tokens: list[int], epoch: int = 1):
    """A session created and fed `tokens` through the runner, as an engine feeds a prompt."""
    import torch

    from specdec.model_runner import ForwardItem

    cache, _ = table.acquire(CacheRef(sid, epoch, 0, tokens), exact=True)
    skip = cache.length
    cache.write_ids(0, tokens)
    table.runner.forward_packed([ForwardItem(cache, torch.tensor(tokens[skip:]), 1)])
    return cache, skip


def test_a_new_session_starts_from_the_longest_prefix_another_cache_holds(draft_model):
    """Prefix reuse: a copy of the keys, values and ids a held cache has for the prompt's
    first tokens (never its last token, which the call must feed for its logits), from live
    sessions and from released ones kept as donors; not below MIN_SHARED tokens, not where
    the caller or the table says no; and the copy is what feeding those tokens computes."""
    import torch

    from specdec.sessions import MAX_RETIRED, MIN_SHARED

    table = SessionTable(ModelRunner(draft_model, linear_kernels="aten"), max_sessions=16)
    base = [(7 * i + 3) % 500 + 10 for i in range(40)]
    a, skip = _fed(table, "a", base)
    assert skip == 0 and table.prefix_reuses == 0
    b, skip = _fed(table, "b", base[:30] + [1, 2, 3])  # shares 30 tokens with a
    assert skip == 30 and b.length == 33 and (b.ids[:33] == base[:30] + [1, 2, 3]).all()
    assert torch.equal(b.kv[:, :, :30], a.kv[:, :, :30])
    fresh = SessionTable(ModelRunner(draft_model, linear_kernels="aten"), reuse_prefixes=False)
    alone, skip = _fed(fresh, "b", base[:30] + [1, 2, 3])
    assert skip == 0 and torch.allclose(alone.kv[:, :, :33], b.kv[:, :, :33], atol=1e-5)
    same, skip = _fed(table, "c", base)  # the same prompt: all but its last token
    assert skip == len(base) - 1
    assert table.prefix_reuses == 2 and table.reused_positions == 30 + 39
    # too short a common prefix, too short a prompt, or reuse refused: computed afresh
    assert _fed(table, "d", base[:MIN_SHARED - 1] + [1] * 10)[1] == 0
    assert _fed(table, "e", base[:MIN_SHARED])[1] == 0
    cache, _ = table.acquire(CacheRef("f", 1, 0, base), exact=True, reuse=False)
    assert cache.length == 0
    # released caches stay donors (the last MAX_RETIRED), and the index forgets sessions
    for sid in ("a", "b", "c", "d", "e", "f"):
        assert table.release(sid)
    # a to d (e too short, f empty), less those a newer one repeats at least half of: b
    # shares 30 of a's 40 positions, c 30 of b's 33; d begins otherwise
    assert not table._by_head and len(table) == 0 and len(table._retired) == 2
    assert _fed(table, "g", base + [9])[1] == len(base)  # c's whole prompt
    for i in range(MAX_RETIRED + 2):
        _fed(table, f"h{i}", [1000 + i] * 20)
        table.release(f"h{i}")
    assert len(table._retired) == MAX_RETIRED
    table.release("g")
    assert table.expire_idle(10.0, now=time.monotonic() + 11.0) == 0 and not table._retired


def test_a_released_cache_replaces_the_donors_it_mostly_repeats(draft_model):
    """A system prompt's sessions, released one after another, leave one donor of it, not
    one each; a donor sharing less than half its positions with the newer stays."""
    table = SessionTable(ModelRunner(draft_model, linear_kernels="aten"), max_sessions=16)
    system = [(5 * i + 1) % 400 + 10 for i in range(24)]
    for i in range(4):
        _fed(table, f"q{i}", system + [500 + i] * 8)  # 24 of 32 positions shared
        table.release(f"q{i}")
    assert [cache.ids[24] for _, cache, _ in table._retired.values()] == [503]
    _fed(table, "long", system[:16] + [600] * 40)  # shares 16 of the donor's 32: half, it goes
    _fed(table, "short", system[:16] + [700] * 60)  # shares 16 of long's 56: long stays
    table.release("long")
    table.release("short")
    assert [cache.length for _, cache, _ in table._retired.values()] == [56, 76]
    assert _fed(table, "again", system[:16] + [600] * 41)[1] == 56  # long's prefix still found


def test_released_donors_go_first_when_the_caches_bytes_are_over(draft_model):
    runner = ModelRunner(draft_model, linear_kernels="aten")
    probe = runner.new_cache()
    table = SessionTable(runner, max_sessions=8, max_cache_bytes=2 * probe.nbytes)  # checked before each new one
    prompt = list(range(10, 40))
    _fed(table, "a", prompt)
    table.release("a")
    assert len(table._retired) == 1
    for sid in ("b", "c", "d"):
        _fed(table, sid, [int(sid, 16)] * 20)
    assert len(table._retired) == 0 and len(table) == 3 and table.evictions == 0  # the donor went, no session
    _fed(table, "e", [14] * 20)
    assert table.evictions == 1 and "b" not in table  # then the least recently used session


def test_growing_caches_make_room_under_the_bytes_budget(draft_model):
    """A budget checked at creation alone let live sessions grow past it while idle ones
    stayed: the growth a batch is about to make evicts donors, then idle sessions."""
    from specdec.errors import Overloaded

    runner = ModelRunner(draft_model, linear_kernels="aten")
    per_position = runner.new_cache().nbytes // runner.new_cache().capacity
    table = SessionTable(runner, max_sessions=8, max_cache_bytes=700 * per_position)
    _fed(table, "idle", [3] * 20)  # 128 positions
    _fed(table, "donor", list(range(20, 50)))
    table.release("donor")
    busy = _fed(table, "busy", [5] * 20)[0]
    assert table.cache_bytes == 3 * 128 * per_position and table.evictions == 0
    table.make_room([(busy, 300)], {"busy"})  # to 384 positions: 640 in all
    assert len(table._retired) == 1 and table.evictions == 0
    table.make_room([(busy, 400)], {"busy"})  # to 512: 768 in all, over 700
    assert not table._retired and "idle" in table and table.evictions == 0  # the donor first
    table.make_room([(busy, 500)], {"busy"})  # to 640: with idle's 128, over
    assert "idle" not in table and table.evictions == 1
    busy.reserve(500)
    assert table.cache_bytes <= table.max_cache_bytes
    table.make_room([(busy, 700)], {"busy"})  # more than the budget, nothing idle: it grows over
    busy.reserve(700)
    assert "busy" in table and table.cache_bytes > table.max_cache_bytes
    with pytest.raises(Overloaded, match=r"KV caches hold \d+ MiB \(max \d+\) and all are in use"):
        table.acquire(CacheRef("new", 1, 0, [7] * 20), exact=True, busy={"busy"})


def test_paged_caches_make_room_under_the_budget_counting_shared_blocks_once(draft_model):
    """Paged caches (a GPU's default): a reused prefix's whole blocks are shared, not copied,
    so they count once, and evicting a donor frees only the blocks no one else holds."""
    from specdec.errors import Overloaded

    runner = ModelRunner(draft_model, attention="paged")
    block = runner.pool.block_bytes
    table = SessionTable(runner, max_sessions=8, max_cache_bytes=20 * block)
    _fed(table, "idle", [3] * 20)  # 2 blocks
    shared = list(range(20, 60))
    _fed(table, "donor", shared)  # 3 blocks
    table.release("donor")
    busy, skip = _fed(table, "busy", shared[:39] + [1])
    assert skip == 39 and table.prefix_reuses == 1
    assert table.cache_bytes == (2 + 3 + 1) * block  # busy holds the donor's first two blocks with it
    table.make_room([(busy, 200)], {"busy"})  # 10 blocks more: 16 of 20
    assert len(table._retired) == 1 and "idle" in table
    table.make_room([(busy, 290)], {"busy"})  # 16 more: the donor frees one block, then idle goes
    assert not table._retired and "idle" not in table and table.evictions == 1
    busy.reserve(290)
    assert table.cache_bytes == 19 * block <= table.max_cache_bytes
    table.make_room([(busy, 400)], {"busy"})  # nothing idle: it grows over
    busy.reserve(400)
    assert table.cache_bytes == 25 * block
    with pytest.raises(Overloaded, match=r"KV caches hold \d+ MiB \(max \d+\) and all are in use"):
        table.acquire(CacheRef("new", 1, 0, [7] * 20), exact=True, busy={"busy"})
