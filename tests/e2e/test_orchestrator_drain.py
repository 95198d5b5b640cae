"""An orchestrator stopped with SIGTERM, as a rolling update of its Deployment stops it:
it refuses new calls, finishes the streams in flight, releases their sessions and exits 0.
Clients see no error but the refusal, which their load balancer sends elsewhere."""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import Streams, api, request, session_keys

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
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                break
            assert time.monotonic() < deadline, "the orchestrator still takes new calls 5 s after SIGTERM"
        for result, want in zip(streams.join(), expected):
            assert not isinstance(result, grpc.RpcError), f"a stream failed: {result.code()} {result.details()}"
            tokens, last = result
            assert tokens == want and last.finish_reason == pb.FINISH_REASON_LENGTH
            assert last.session_id not in session_keys(local_stack)  # released, not left to expire
        assert leaving.proc.wait(15) == 0
    finally:
        local_stack.orchestrators.remove(leaving)
        if leaving.proc.poll() is None:
            leaving.proc.kill()
