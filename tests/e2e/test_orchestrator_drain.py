"""An orchestrator stopped with SIGTERM, as a rolling update of its Deployment stops it:
it refuses new calls, finishes the streams in flight, releases their sessions and exits 0.
Clients see no error but the refusal, which their load balancer sends elsewhere. Streams
still running when the drain's grace ends are cut, and their sessions still released."""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import Streams, api, exit_status, load_report, redis_client, request, session_handles, session_keys

pytestmark = pytest.mark.e2e
PROMPTS = ["def main(", "class Parser:\n    def __init__(self"]
NEW_TOKENS = 384  # about 1 s a stream here: well inside the stack's 5 s drain


def test_a_draining_orchestrator_finishes_its_streams_and_refuses_new_calls(local_stack):
    expected = [list(api(local_stack.orchestrator_address).Generate(request(p, NEW_TOKENS, 0.0), timeout=120).token_ids)
                for p in PROMPTS]
    leaving = local_stack.start_orchestrator()
    try:
        stub = api(leaving.address)
        streams = Streams(stub, [request(p, NEW_TOKENS, 0.0) for p in PROMPTS])
        streams.wait_first_chunks()
        leaving.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # calls that arrive before the drain begins are served like the rest
            try:
                stub.Generate(request("def f(", 2, 0.0), timeout=10)
            except grpc.RpcError as exc:
                # not CANCELLED, which calls reaching a server already stopping got before
                # the servicer refused them itself (retry policies retry UNAVAILABLE only)
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                assert "shutting down" in exc.details()
                break
            assert time.monotonic() < deadline, "the orchestrator still takes new calls 5 s after SIGTERM"
        for result, want in zip(streams.join(), expected):
            assert not isinstance(result, grpc.RpcError), f"a stream failed: {result.code()} {result.details()}"
            tokens, last = result
            assert tokens == want and last.finish_reason == pb.FINISH_REASON_LENGTH
            assert last.session_id not in session_keys(local_stack)  # released, not left to expire
        assert exit_status(local_stack, leaving) == 0
    finally:
        local_stack.orchestrators.remove(leaving)
        if leaving.proc.poll() is None:
            leaving.proc.kill()


def test_streams_cut_by_the_drains_end_still_release_their_sessions(local_stack):
    """Before: the process closed its channels and Redis as soon as the server stopped, and
    every cut session's handle stayed in Redis until its TTL, its caches on both replicas
    until evicted (Generator.wind_down)."""
    replicas = [r for r in local_stack.replicas if r.proc.poll() is None]
    before = {r.address: load_report(r.address, r.kind).sessions for r in replicas}
    handles_before = set(session_handles(local_stack))  # earlier tests' (a request id's answer, kept for retries)
    leaving = local_stack.start_orchestrator(extra=["--drain-seconds", "0.5"])
    try:
        stub = api(leaving.address)
        requests = [request(p, 1024, 0.0) for p in PROMPTS] + [request("import os\n", 1024, 0.0, keep_session=True)]
        streams = Streams(stub, requests)
        streams.wait_first_chunks()
        leaving.proc.send_signal(signal.SIGTERM)
        results = streams.join()
        assert all(isinstance(r, grpc.RpcError) for r in results), "a 1,024-token stream outlived a 0.5 s drain"
        assert exit_status(local_stack, leaving) == 0
    finally:
        local_stack.orchestrators.remove(leaving)
    client = redis_client(local_stack)
    kept = [k.decode().split(":")[2] for k in client.keys("specdec:session:*") if k.endswith(b":lock")]
    handles = {sid: h for sid, h in session_handles(local_stack).items() if sid not in handles_before}
    # the ephemeral sessions are gone; the kept one stays, continuable and not held
    assert len(handles) == 1 and not kept, (handles, kept)
    assert {r.address: load_report(r.address, r.kind).sessions for r in replicas} == \
        {address: n + 1 for address, n in before.items()}
    api(local_stack.orchestrator_address).EndSession(pb.EndSessionRequest(session_id=next(iter(handles))), timeout=30)
