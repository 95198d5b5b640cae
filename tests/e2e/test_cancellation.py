"""Cancelled and timed-out calls free their caches at once; the orchestrator and the
replicas bound what they hold (RESOURCE_EXHAUSTED, LRU eviction with a clean rebuild).

This module's stack runs on asyncio's own event loop (`--event-loop asyncio`), the rest of
the suite on the default, uvloop's: cancellation and deadlines are where two loops differ
most, and both stay tested."""
from __future__ import annotations

import time

import grpc
import pytest

from localstack.stack import LocalStack
from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import Streams, api, held_sessions, live_replicas, load_report, request, session_keys
from tests.stacks import started_stack, stopped

pytestmark = pytest.mark.e2e
LONG = 1024  # tokens (the orchestrator's default cap): over a second at one stream here, far more than a test waits


@pytest.fixture(scope="module")
def stack(bundled_paths):
    stack = started_stack(lambda: LocalStack(extra_env={"SPECDEC_EVENT_LOOP": "asyncio"}))
    yield stack
    stopped(stack)


def test_the_stack_runs_on_asyncios_loop(stack):
    logs = [path.read_text(errors="replace") for path in stack.workdir.glob("*.log") if "redis" not in path.name]
    assert len(logs) == 3 and all("event loop asyncio" in log for log in logs)


def wait_released(stack, before: dict[str, int], keys_before: set[str], within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while (held_sessions(stack), session_keys(stack)) != (before, keys_before):
        assert time.monotonic() < deadline, f"not released: {held_sessions(stack)} (before {before}), " \
                                            f"handles {session_keys(stack) - keys_before}"
        time.sleep(0.1)


def test_a_cancelled_stream_releases_both_caches(stack):
    stub = api(stack.orchestrator_address)
    before, keys = held_sessions(stack), session_keys(stack)
    call = stub.GenerateStream(request("def render(template, **kw):\n", LONG, 0.0, gamma=3), timeout=120)
    next(call)
    assert all(n == before[a] + 1 for a, n in held_sessions(stack).items()), "the stream holds no cache"
    call.cancel()
    wait_released(stack, before, keys)
    target = live_replicas(stack, "target")[0].address
    at_release = load_report(target, "target").forward_passes
    settled = wait_quiet(target)
    assert settled - at_release <= 1, "the loop went on after the cancel (beyond the pass in flight)"


def wait_quiet(address: str, window: float = 0.5, within: float = 5.0) -> int:
    """The target's forward-pass count once it has stopped moving for `window` seconds."""
    deadline = time.monotonic() + within
    passes = load_report(address, "target").forward_passes
    while time.monotonic() < deadline:
        time.sleep(window)
        now = load_report(address, "target").forward_passes
        if now == passes:
            return now
        passes = now
    raise AssertionError("the target kept computing after the stream was cancelled")


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_an_expired_deadline_is_deadline_exceeded_and_releases_both_caches(stack, method):
    stub = api(stack.orchestrator_address)
    before, keys = held_sessions(stack), session_keys(stack)
    req = request("import json\n\ndef load(path):\n", LONG, 0.0, gamma=3)
    # the deadline lands at different points of a round, always well before LONG tokens are
    # done (512 tokens took under 1.3 s once the draft's and the forward's kernels sped up)
    for timeout in (0.15, 0.3, 0.45, 0.6):
        with pytest.raises(grpc.RpcError) as err:
            if method == "Generate":
                stub.Generate(req, timeout=timeout)
            else:
                list(stub.GenerateStream(req, timeout=timeout))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_released(stack, before, keys)


def test_the_orchestrator_refuses_calls_beyond_max_concurrent(stack):
    bounded = stack.start_orchestrator(extra=["--max-concurrent", "2"])
    stub = api(bounded.address)
    streams = Streams(stub, [request(f"def task{i}():\n", LONG, 0.0) for i in range(2)])
    try:
        streams.wait_first_chunks()
        for call in (lambda r: stub.Generate(r, timeout=30), lambda r: list(stub.GenerateStream(r, timeout=30))):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call(request("x = 1\n", 4, 0.0))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit of 2 concurrent" in err.value.details()
            assert time.monotonic() - t0 < 2.0
    finally:
        streams.cancel()
        streams.join()
    deadline = time.monotonic() + 5
    while True:  # the slots come back once the cancelled streams have wound down
        try:
            assert len(stub.Generate(request("x = 1\n", 4, 0.0), timeout=30).token_ids) == 4
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.2)
    stack.kill(bounded, sig=15)
    stack.orchestrators.remove(bounded)


def conversation(stub, prompt: str) -> list[list[int]]:
    first = stub.Generate(request(prompt, 16, 0.0, keep_session=True), timeout=120)
    more = stub.Generate(request("", 16, 0.0, session_id=first.session_id), timeout=120)
    stub.EndSession(pb.EndSessionRequest(session_id=first.session_id), timeout=30)
    return [list(first.token_ids), list(more.token_ids)]


def test_a_full_target_evicts_idle_sessions_and_rebuilds_one_that_returns(stack):
    for rep in live_replicas(stack, "target"):  # swap in a target that holds two sessions
        stack.kill(rep, sig=15)
    small = stack.start_replica("target", extra=["--max-sessions", "2"])
    stack.wait_registered(1, 1)
    stub = api(stack.orchestrator_address)
    prompts = ["def area(r):\n", "class Point:\n", "while True:\n"]
    expected = conversation(stub, prompts[0])

    kept = [stub.Generate(request(p, 16, 0.0, keep_session=True), timeout=120) for p in prompts]
    assert {k.stats.target_replica for k in kept} == {small.address}
    report = load_report(small.address, "target")
    assert report.sessions == 2 and report.evictions == 1  # the third evicted the least recent

    again = stub.Generate(request("", 16, 0.0, session_id=kept[0].session_id), timeout=120)
    assert [list(kept[0].token_ids), list(again.token_ids)] == expected
    assert again.stats.target_replica == small.address and again.stats.replica_failovers == 0
    rebuilt = load_report(small.address, "target")
    assert rebuilt.evictions == 2 and rebuilt.sessions == 2
    assert rebuilt.prefill_tokens - report.prefill_tokens >= again.stats.prompt_tokens  # the whole history
    for k in kept:
        stub.EndSession(pb.EndSessionRequest(session_id=k.session_id), timeout=30)
