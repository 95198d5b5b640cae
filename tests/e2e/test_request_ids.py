"""A call retried with its request_id continues its first attempt (orchestrator/request_ids.py):
a cut stream, or an orchestrator killed mid-call, is retried into the very answer an
uninterrupted call gives; a whole answer is given again without generating; a kept
session's prompt is appended once however often the call is retried."""
from __future__ import annotations

import signal
import time
import uuid

import grpc
import pytest

from localstack.stack import free_port, scrape_metrics
from orchestrator.request_ids import session_for
from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import Streams, api, killed_mid_stream, redis_client, request
from tests.e2e.test_session_lease import committed

pytestmark = pytest.mark.e2e
LONG = 400  # long enough that a stream cut after its first chunk has most of it to go
# seeded sampled tokens depend on the γs chosen: with the adaptive γ the retry goes on from
# the policy's state committed with the last round (SessionPolicy.snapshot)
CASES = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, gamma=4, seed=7),
         "seeded_adaptive": dict(temperature=1.0, seed=11)}


def rid() -> str:
    return uuid.uuid4().hex


def cut_after_first_chunk(stub, req) -> list[int]:
    """A stream the client gives up on after its first chunk → the tokens it received."""
    streams = Streams(stub, [req])
    streams.wait_first_chunks()
    streams.cancel()
    result, = streams.join()
    assert isinstance(result, grpc.RpcError), "the stream ended before the client cut it"
    return streams.tokens[0]


def retried(stub, req, within: float = 30.0) -> pb.GenerateResponse:
    """The call sent again until the session is free (ABORTED while the cut attempt's call
    is still ending, or until a dead orchestrator's lease runs out)."""
    started = time.monotonic()
    while True:
        try:
            return stub.Generate(req, timeout=120)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.ABORTED and time.monotonic() - started < within, exc.details()
            time.sleep(0.1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cut_stream_retried_with_its_id_ends_as_the_uninterrupted_answer(local_stack, case):
    stub = api(local_stack.orchestrator_address)
    reference = stub.Generate(request("def main(", LONG, **CASES[case]), timeout=120)
    req = request("def main(", LONG, **CASES[case], request_id=rid())
    received = cut_after_first_chunk(stub, req)
    again = retried(stub, req)
    assert list(again.token_ids) == list(reference.token_ids)
    assert again.text == reference.text and again.finish_reason == reference.finish_reason
    assert received and list(again.token_ids[:len(received)]) == received
    assert len(received) <= again.stats.resumed_tokens < LONG  # what the cut attempt committed, kept
    assert again.stats.prompt_tokens == reference.stats.prompt_tokens


def test_a_retry_ends_at_the_stop_string_the_uninterrupted_answer_ends_at(local_stack):
    """The text of what the cut attempt committed is decoded again, held-back pieces and all,
    so that a stop string reached after the cut ends the retried answer where it ends an
    uninterrupted one."""
    stub = api(local_stack.orchestrator_address)
    seeded = dict(temperature=0.8, gamma=4, seed=3)  # greedy text here repeats itself early
    whole = stub.Generate(request("def main(", LONG, **seeded), timeout=120)
    late = whole.text[len(whole.text) * 2 // 3:]
    stop = next(late[i:i + 6] for i in range(len(late)) if late[i:i + 6].strip() and late[i:i + 6] not in
                whole.text[:len(whole.text) * 2 // 3 + i + 5])  # first seen two thirds of the way in
    reference = stub.Generate(request("def main(", LONG, **seeded, stop=[stop]), timeout=120)
    assert reference.finish_reason == pb.FINISH_REASON_STOP and len(reference.token_ids) > LONG // 2
    req = request("def main(", LONG, **seeded, stop=[stop], request_id=rid())
    received = cut_after_first_chunk(stub, req)
    again = retried(stub, req)
    assert (list(again.token_ids), again.text, again.finish_reason) == (
        list(reference.token_ids), reference.text, reference.finish_reason)
    assert len(received) <= again.stats.resumed_tokens < len(reference.token_ids)
    # once whole, its stop string lies in what was committed: answered again, not continued
    replay = stub.Generate(req, timeout=120)
    assert (list(replay.token_ids), replay.text, replay.finish_reason, replay.stats.rounds) == (
        list(reference.token_ids), reference.text, reference.finish_reason, 0)


def test_a_whole_answer_is_given_again_without_generating(local_stack):
    port = free_port()
    metered = local_stack.start_orchestrator(extra=["--metrics-port", str(port)])
    try:
        stub = api(metered.address)
        req = request("def parse(", 48, 1.0, request_id=rid())  # no seed: a second sampling would differ
        first = stub.Generate(req, timeout=120)
        chunks = list(stub.GenerateStream(req, timeout=120))
        again = stub.Generate(req, timeout=120)
        assert scrape_metrics(port)['specdec_requests_resumed_total{how="answered"}'] == 2
    finally:
        local_stack.orchestrators.remove(metered)
        local_stack.kill(metered, signal.SIGTERM)
    for tokens, text, last in ([list(c.token_ids) for c in chunks], "".join(c.text for c in chunks), chunks[-1]), \
            ([list(again.token_ids)], again.text, again):
        assert sum(tokens, []) == list(first.token_ids) and text == first.text
        assert last.finish_reason == first.finish_reason and last.stats.seed == first.stats.seed
        assert last.stats.rounds == 0 and last.stats.resumed_tokens == len(first.token_ids)
    # kept in Redis for the retry window, its caches released on both replicas
    handle = {k.decode(): v.decode() for k, v in redis_client(local_stack).hgetall(
        f"specdec:session:{first.session_id}").items()}
    assert first.session_id == session_for(req.request_id)
    assert (handle["draft"], handle["target"]) == ("", "")
    assert first.stats.target_replica  # though the call's own stats name the replica it ran on
    assert 0 < redis_client(local_stack).ttl(f"specdec:session:{first.session_id}") <= 120


def test_a_kept_sessions_prompt_is_appended_once_however_often_it_is_retried(local_stack):
    stub = api(local_stack.orchestrator_address)
    first = request("def main(", 8, 0.0, keep_session=True, request_id=rid())
    sid = stub.Generate(first, timeout=120).session_id
    before = committed(local_stack, sid)
    follow = request("\n    x = ", LONG, 0.0, session_id=sid, request_id=rid())
    cut_after_first_chunk(stub, follow)
    answer = retried(stub, follow)
    prompt = committed(local_stack, sid)[len(before):len(committed(local_stack, sid)) - len(answer.token_ids)]
    assert committed(local_stack, sid) == before + prompt + list(answer.token_ids)
    assert len(prompt) == answer.stats.prompt_tokens - len(before) > 0  # once, though sent twice
    fresh = stub.Generate(pb.GenerateRequest(prompt_token_ids=before + prompt, max_new_tokens=LONG, temperature=0.0),
                          timeout=120)
    assert list(answer.token_ids) == list(fresh.token_ids)  # greedy: the target's own continuation
    # an earlier request of the session is answered again as it was, appending nothing
    held = committed(local_stack, sid)
    again = stub.Generate(first, timeout=120)
    assert list(again.token_ids) == held[len(before) - 8:len(before)] and again.stats.rounds == 0
    assert committed(local_stack, sid) == held
    stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)


def test_a_cut_request_cannot_continue_once_its_session_went_on(local_stack):
    stub = api(local_stack.orchestrator_address)
    sid = stub.Generate(request("def main(", 8, 0.0, keep_session=True), timeout=120).session_id
    cut = request("", LONG, 0.0, session_id=sid, request_id=rid())
    cut_after_first_chunk(stub, cut)
    retried(stub, request("", 4, 0.0, session_id=sid))  # the client went on without it
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(cut, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has gone on to another request" in err.value.details()
    stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)


def test_an_id_is_refused_for_another_request_and_while_its_first_attempt_runs(local_stack):
    stub = api(local_stack.orchestrator_address)
    used = rid()
    stub.Generate(request("def main(", 4, 0.0, request_id=used), timeout=120)
    for bad, words in ((request("def other(", 4, 0.0, request_id=used), "was used for a different request"),
                       (request("def main(", 4, 0.0, request_id="no spaces"), "request_id must be")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(bad, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    running = request("def main(", 1024, 0.0, gamma=0, request_id=rid())
    streams = Streams(stub, [running])
    streams.wait_first_chunks()
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(running, timeout=60)
    assert err.value.code() == grpc.StatusCode.ABORTED and "in use by another call" in err.value.details()
    (tokens, last), = streams.join()  # the refused attempt took nothing from the first
    assert len(tokens) == 1024 and last.stats.resumed_tokens == 0


def test_a_call_whose_orchestrator_died_is_retried_elsewhere_into_the_same_answer(local_stack):
    doomed = local_stack.start_orchestrator(extra=["--session-lease", "2"])
    req = request("def main(", 1024, 0.0, gamma=0, request_id=rid())
    streams = Streams(api(doomed.address), [req])
    killed_mid_stream(local_stack, doomed, streams)
    survivor = api(local_stack.orchestrator_address)
    again = retried(survivor, req, within=2 + 10)
    reference = survivor.Generate(request("def main(", 1024, 0.0, gamma=0), timeout=120)
    assert list(again.token_ids) == list(reference.token_ids)
    assert len(streams.tokens[0]) <= again.stats.resumed_tokens < 1024
