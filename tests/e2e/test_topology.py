"""Two draft and two target replicas: placement, stickiness, registry life cycle."""
from __future__ import annotations

import time

import pytest

from tests.e2e.helpers import api, load_report, redis_client, request
from tests.stacks import started_stack, stopped

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def wide_stack(bundled_paths):
    stack = started_stack(drafts=2, targets=2)
    yield stack
    stopped(stack)


def test_sessions_spread_and_stick(wide_stack):
    stub = api(wide_stack.orchestrator_address)
    placed = []
    for i in range(6):
        r = stub.Generate(request(f"def f{i}(x):\n", 8, 0.0, keep_session=True), timeout=120)
        placed.append((r.session_id, r.stats.draft_replica, r.stats.target_replica))
    assert len({t for _, _, t in placed}) == 2, "sessions should spread over both targets"
    assert len({d for _, d, _ in placed}) == 2, "sessions should spread over both drafts"
    for sid, draft, target in placed:
        again = stub.Generate(request("    return x\n", 8, 0.0, session_id=sid), timeout=120)
        assert (again.stats.draft_replica, again.stats.target_replica) == (draft, target)
    held = {rep.address: load_report(rep.address, rep.kind).sessions for rep in wide_stack.replicas}
    for _, draft, target in placed:
        assert held[draft] >= 1 and held[target] >= 1


def test_replicas_register_and_leave_on_shutdown(wide_stack):
    r = redis_client(wide_stack)
    extra = wide_stack.start_replica("draft")
    deadline = time.time() + 10
    while extra.address.encode() not in r.smembers("specdec:pool:draft") and time.time() < deadline:
        time.sleep(0.1)
    assert r.get(f"specdec:replica:draft:{extra.address}") is not None
    wide_stack.kill(extra, sig=15)  # graceful: deregisters
    wide_stack.replicas.remove(extra)
    assert r.get(f"specdec:replica:draft:{extra.address}") is None
    assert extra.address.encode() not in r.smembers("specdec:pool:draft")
