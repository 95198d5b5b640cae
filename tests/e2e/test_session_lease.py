"""One call at a time holds a session, by a lease in Redis that each round's commit renews
(specdec/session_store.py): a second call and EndSession are refused while it runs, a
session whose orchestrator died is free again after the lease and continues from what was
committed, a call whose session another took stops rather than write over it, and a
handle lost mid-generation is written again whole."""
from __future__ import annotations

import re
import signal
import time

import grpc
import numpy as np
import pytest

from localstack.stack import free_port, scrape_metrics
from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import Streams, api, killed_mid_stream, redis_client, request, session_keys

pytestmark = pytest.mark.e2e
LONG = 1024  # greedy target-only from "def main(": about 2 s here, no end of text before it
ABORTED = grpc.StatusCode.ABORTED


@pytest.fixture(scope="module")
def metered(local_stack):
    """An orchestrator of the shared stack with its metrics on: → (address, metrics port)."""
    port = free_port()
    rep = local_stack.start_orchestrator(extra=["--metrics-port", str(port)])
    yield rep.address, port
    local_stack.orchestrators.remove(rep)
    local_stack.kill(rep, signal.SIGTERM)


def kept_session(stub) -> str:
    return stub.Generate(request("def main(", 8, 0.0, keep_session=True), timeout=120).session_id


def committed(stack, sid: str) -> list[int]:
    """The session's committed tokens as Redis holds them."""
    client = redis_client(stack)
    length = int(client.hget(f"specdec:session:{sid}", "length"))
    return np.frombuffer(client.get(f"specdec:session:{sid}:tokens"), dtype=np.int32)[:length].tolist()


def long_stream(stub, sid: str) -> Streams:
    streams = Streams(stub, [request("", LONG, 0.0, gamma=0, session_id=sid)])
    streams.wait_first_chunks()
    return streams


def refused(call, req) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(req, timeout=30)
    assert err.value.code() == ABORTED, err.value.details()
    return err.value


def test_a_session_generating_refuses_a_second_call_and_its_end(local_stack, metered):
    address, port = metered
    stub = api(address)
    sid = kept_session(stub)
    before = committed(local_stack, sid)
    streams = long_stream(stub, sid)
    err = refused(stub.Generate, request("x", 4, 0.0, session_id=sid))
    assert "in use by another call" in err.details()
    refused(stub.EndSession, pb.EndSessionRequest(session_id=sid))
    assert scrape_metrics(port)['specdec_session_conflicts_total{reason="in_use"}'] == 2
    (tokens, last), = streams.join()
    assert len(tokens) == LONG and last.finish_reason == pb.FINISH_REASON_LENGTH  # the refused calls took nothing from it
    assert committed(local_stack, sid) == before + tokens
    stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)
    assert sid not in session_keys(local_stack)


def test_a_session_whose_orchestrator_died_is_free_after_the_lease_and_continues(local_stack):
    doomed = local_stack.start_orchestrator(extra=["--session-lease", "2"])
    stub = api(doomed.address)
    sid = kept_session(stub)
    before = committed(local_stack, sid)
    streams = long_stream(stub, sid)
    killed_mid_stream(local_stack, doomed, streams)
    received = streams.tokens[0]
    held = committed(local_stack, sid)
    # a round's tokens reach the client only once committed: what it got is all in Redis
    assert received and held[len(before):len(before) + len(received)] == received

    survivor = api(local_stack.orchestrator_address)
    started = time.monotonic()
    err = refused(survivor.Generate, request("", 8, 0.0, session_id=sid))
    assert int(re.search(r"free within (\d+) s", err.details()).group(1)) <= 2
    while True:
        try:
            resumed = survivor.Generate(request("", 8, 0.0, session_id=sid), timeout=60)
            break
        except grpc.RpcError as exc:
            assert exc.code() == ABORTED and time.monotonic() - started < 2 + 5, exc.details()
            time.sleep(0.2)
    assert committed(local_stack, sid) == held + list(resumed.token_ids)
    # greedy: the continuation is the target's greedy continuation of what was committed,
    # though the replicas' caches still held the dead call's uncommitted rounds
    fresh = survivor.Generate(pb.GenerateRequest(prompt_token_ids=held, max_new_tokens=8, temperature=0.0),
                              timeout=60)
    assert list(resumed.token_ids) == list(fresh.token_ids)
    survivor.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)


def test_a_call_whose_session_another_took_stops_without_writing_over_it(local_stack, metered):
    address, port = metered
    stub = api(address)
    sid = kept_session(stub)
    client = redis_client(local_stack)
    lock = f"specdec:session:{sid}:lock"
    streams = long_stream(stub, sid)
    client.set(lock, "another-call")  # as a call that found this one's lease lapsed and took the session
    length = int(client.hget(f"specdec:session:{sid}", "length"))
    result, = streams.join()
    assert isinstance(result, grpc.RpcError) and result.code() == ABORTED, result
    assert "taken over by another call" in result.details()
    assert int(client.hget(f"specdec:session:{sid}", "length")) == length  # nothing written after
    assert client.get(lock) == b"another-call"  # and its end did not free the other's hold
    assert scrape_metrics(port)['specdec_session_conflicts_total{reason="taken_over"}'] == 1
    client.delete(lock)
    stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)


def test_a_handle_lost_mid_generation_is_written_again_whole(local_stack, metered):
    """As after a Redis that lost its last second of writes: before, the next commit wrote
    the handle back as zero tokens up to its round's place."""
    address, port = metered
    stub = api(address)
    sid = kept_session(stub)
    before = committed(local_stack, sid)
    streams = long_stream(stub, sid)
    redis_client(local_stack).delete(*(f"specdec:session:{sid}{k}" for k in ("", ":tokens", ":lock")))
    (tokens, last), = streams.join()
    assert len(tokens) == LONG
    assert committed(local_stack, sid) == before + tokens
    assert scrape_metrics(port)["specdec_session_handles_rewritten_total"] == 1
    stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)


def test_a_replica_releases_a_cache_left_idle_past_its_limit(local_stack, tokenizer):
    """What an orchestrator that died leaves on the replicas: caches no call will use again,
    counted in the load that routing and autoscaling read, until evicted for room."""
    from specdec.internal.v1 import replica_pb2 as rpb
    from specdec.internal.v1 import replica_pb2_grpc as rpb_grpc
    from tests.e2e.helpers import load_report

    rep = local_stack.start_replica("target", extra=["--session-idle-seconds", "1"])
    try:
        channel = grpc.insecure_channel(rep.address)
        prompt = tokenizer("def main(")["input_ids"]
        cache = rpb.CacheRef(session_id="orphan", epoch=1, start=0, tokens=prompt)
        rpb_grpc.TargetStub(channel).Verify(rpb.VerifyRequest(cache=cache, sampling=rpb.SamplingParams(temperature=0.0, top_p=1.0)),
                                            timeout=30)
        assert load_report(rep.address, "target").sessions == 1
        deadline = time.monotonic() + 10  # idle 1 s, then the next heartbeat (every 2 s)
        while load_report(rep.address, "target").sessions and time.monotonic() < deadline:
            time.sleep(0.2)
        assert load_report(rep.address, "target").sessions == 0
        assert "released 1 session(s) idle" in "\n".join(local_stack.log_tail(rep, 20))
        channel.close()
    finally:
        local_stack.replicas.remove(rep)
        local_stack.kill(rep, signal.SIGTERM)
