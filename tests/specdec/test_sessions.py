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
