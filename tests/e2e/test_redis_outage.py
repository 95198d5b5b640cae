"""Redis restarts and outages: sessions survive (AOF), streams in flight ride out a short
restart, new calls fail fast with UNAVAILABLE while Redis is down, and service resumes by
itself when it is back."""
from __future__ import annotations

import json
import time

import grpc
import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import Streams, api, redis_client, request, session_keys

pytestmark = pytest.mark.e2e

PROMPTS = ["def merge(a, b):\n", "class Queue:\n", "with open(path) as f:\n"]


def restart_redis(stack, down_seconds: float) -> float:
    """Stop Redis (SIGTERM: it flushes its AOF), wait, start it on the same port and
    directory; → the time it came back."""
    port = stack.redis_port
    stack.stop_redis()
    time.sleep(down_seconds)
    stack.start_redis(port=port)
    return time.time()


def all_alive(stack) -> bool:
    return all(rep.proc.poll() is None for rep in stack.replicas + stack.orchestrators)


def conversation(stub, prompt: str, lengths=(16, 32, 16)) -> list[list[int]]:
    """The tokens of each call of an undisturbed kept session: the greedy reference."""
    first = stub.Generate(request(prompt, lengths[0], 0.0, keep_session=True), timeout=120)
    parts = [list(first.token_ids)]
    for n in lengths[1:]:
        parts.append(list(stub.Generate(request("", n, 0.0, session_id=first.session_id), timeout=120).token_ids))
    stub.EndSession(pb.EndSessionRequest(session_id=first.session_id), timeout=30)
    return parts


def test_sessions_and_streams_survive_a_redis_restart(stack):
    stub = api(stack.orchestrator_address)
    expected = [conversation(stub, p) for p in PROMPTS[:2]]
    single = list(stub.Generate(request(PROMPTS[2], 64, 0.0), timeout=120).token_ids)
    kept = [stub.Generate(request(p, 16, 0.0, keep_session=True), timeout=120) for p in PROMPTS[:2]]
    # in flight across the restart: continuations of the kept sessions and a new stream
    streams = Streams(stub, [request("", 32, 0.0, session_id=k.session_id) for k in kept]
                      + [request(PROMPTS[2], 64, 0.0)])
    streams.wait_first_chunks()
    restart_redis(stack, down_seconds=1.0)
    results = streams.join()
    for result in results:
        assert not isinstance(result, grpc.RpcError), f"{result.code()}: {result.details()}"
    assert results[2][0] == single
    # the kept sessions go on from where they stood, by their id
    for first, result, want in zip(kept, results, expected):
        more = stub.Generate(request("", 16, 0.0, session_id=first.session_id), timeout=120)
        assert [list(first.token_ids), result[0], list(more.token_ids)] == want
    assert session_keys(stack) == {k.session_id for k in kept}  # the ephemeral one left nothing
    for k in kept:
        stub.EndSession(pb.EndSessionRequest(session_id=k.session_id), timeout=30)
    assert all_alive(stack)


def test_redis_down_fails_fast_and_service_resumes_by_itself(stack):
    stub = api(stack.orchestrator_address)
    kept = stub.Generate(request(PROMPTS[0], 8, 0.0, keep_session=True), timeout=120)
    port = stack.redis_port
    stack.stop_redis()
    try:
        calls = {
            "Generate": lambda: stub.Generate(request(PROMPTS[1], 8, 0.0), timeout=30),
            "GenerateStream": lambda: list(stub.GenerateStream(request(PROMPTS[1], 8, 0.0), timeout=30)),
            "continue a session": lambda: stub.Generate(request("x", 8, 0.0, session_id=kept.session_id), timeout=30),
            "EndSession": lambda: stub.EndSession(pb.EndSessionRequest(session_id=kept.session_id), timeout=30),
        }
        for name, call in calls.items():
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert time.monotonic() - t0 < 3.0, f"{name} took too long to fail"
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, f"{name}: {err.value.details()}"
            assert "Redis" in err.value.details(), name
        time.sleep(0.5)
        assert all_alive(stack), "a process died while Redis was down"
    finally:
        stack.start_redis(port=port)
    back = time.time()

    deadline = time.monotonic() + 15
    while True:  # no service is restarted: the first calls after the restart may still fail
        try:
            stub.Generate(request(PROMPTS[1], 8, 0.0), timeout=30)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc.details()
            time.sleep(0.2)
    for _ in range(3):
        assert len(stub.Generate(request(PROMPTS[1], 8, 0.0), timeout=30).token_ids) == 8
    more = stub.Generate(request("", 8, 0.0, session_id=kept.session_id), timeout=30)
    assert more.session_id == kept.session_id
    stub.EndSession(pb.EndSessionRequest(session_id=kept.session_id), timeout=30)

    client = redis_client(stack)  # every replica heartbeat has written its entry since
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        entries = [client.get(f"specdec:replica:{rep.kind}:{rep.address}") for rep in stack.replicas]
        if all(e is not None and json.loads(e)["updated"] > back for e in entries):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the replicas did not re-register after Redis came back")
    assert all_alive(stack)
