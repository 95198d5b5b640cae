"""Sessions an orchestrator that died left running are released by the others
(orchestrator/reaper.py): their handles and both replicas' caches, once the dead call's
lease has run out, while kept sessions stay and a live orchestrator's calls go on."""
from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from orchestrator.request_ids import session_for
from orchestrator.reaper import ORCHESTRATORS
from specdec.session_store import EPHEMERAL
from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import Streams, api, killed_mid_stream, load_report, redis_client, request, session_handles
from tests.e2e.test_request_ids import cut_after_first_chunk, retried, rid

pytestmark = pytest.mark.e2e


def test_a_killed_orchestrators_sessions_are_released_by_another(local_stack):
    replicas = [r for r in local_stack.replicas if r.proc.poll() is None]
    held_before = {r.address: load_report(r.address, r.kind).sessions for r in replicas}
    handles_before = set(session_handles(local_stack))
    doomed = local_stack.start_orchestrator(extra=["--session-lease", "2"])
    live = Streams(api(local_stack.orchestrator_address), [request("def walk(path):\n", 400, 0.0)])
    cut = Streams(api(doomed.address), [request("def main(", 1024, 0.0), request("class A:\n", 1024, 0.0),
                                        request("import os\n", 1024, 0.0, keep_session=True)])
    cut.wait_first_chunks()
    live.wait_first_chunks()
    listed = {k.decode(): v.decode() for k, v in redis_client(local_stack).hgetall(EPHEMERAL).items()}
    # each new session no call can name is listed with its orchestrator: two of the one to die,
    # one of the live one (the kept session is not listed)
    assert sorted(Counter(listed.values()).values()) == [1, 2], listed
    doomed_id = next(owner for owner, n in Counter(listed.values()).items() if n == 2).encode()
    assert doomed_id in redis_client(local_stack).smembers(ORCHESTRATORS)
    killed_mid_stream(local_stack, doomed, cut)
    killed = time.monotonic()
    deadline = time.monotonic() + 30
    while True:
        handles = {sid for sid in session_handles(local_stack) if sid not in handles_before}
        held = {r.address: load_report(r.address, r.kind).sessions for r in replicas}
        ids = redis_client(local_stack).smembers(ORCHESTRATORS)  # earlier tests' dead ones may go meanwhile
        if len(handles) == 1 and held == {a: n + 1 for a, n in held_before.items()} and doomed_id not in ids \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"released {time.monotonic() - killed:.1f} s after the kill")
    # the two sessions no call can name again are gone; the kept one stays, to be continued
    assert len(handles) == 1, handles
    assert held == {a: n + 1 for a, n in held_before.items()}, (held, held_before)
    assert not redis_client(local_stack).hgetall(EPHEMERAL)
    assert doomed_id not in ids  # the dead orchestrator's id, nothing of it left to release, is dropped
    (tokens, last), = live.join()  # a live orchestrator's call is never taken, however long
    assert len(tokens) == 400 and last.finish_reason == pb.FINISH_REASON_LENGTH
    kept = handles.pop()
    stub = api(local_stack.orchestrator_address)
    more = stub.Generate(request("\n", 4, 0.0, session_id=kept), timeout=60)
    assert len(more.token_ids) == 4
    stub.EndSession(pb.EndSessionRequest(session_id=kept), timeout=30)


def test_a_cut_answer_s_caches_go_after_its_retry_window_and_a_later_retry_still_continues(local_stack):
    """A request id's cut answer keeps its session for the retry; once `--retry-window` has
    passed with no retry, its caches are released on both replicas and its handle kept, so
    that a later retry still ends as the uninterrupted answer, from caches built again."""
    replicas = [r for r in local_stack.replicas if r.proc.poll() is None]
    held_before = {r.address: load_report(r.address, r.kind).sessions for r in replicas}
    brief = local_stack.start_orchestrator(extra=["--retry-window", "1"])
    try:
        stub = api(brief.address)
        reference = stub.Generate(request("def main(", 300, 0.0), timeout=120)
        req = request("def main(", 300, 0.0, request_id=rid())
        received = cut_after_first_chunk(stub, req)
        sid = session_for(req.request_id)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            held = {r.address: load_report(r.address, r.kind).sessions for r in replicas}
            if held == held_before:
                break
            time.sleep(0.5)
        assert held == held_before, "the cut answer's caches outlived its retry window"
        handle = session_handles(local_stack)[sid]
        assert (handle["draft"], handle["target"]) == ("", "") and 0 < int(handle["length"])
        again = retried(api(local_stack.orchestrator_address), req)
        assert list(again.token_ids) == list(reference.token_ids) and again.token_ids[:len(received)] == received
        assert 0 < again.stats.resumed_tokens < len(again.token_ids)
        api(local_stack.orchestrator_address).EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)
    finally:
        local_stack.orchestrators.remove(brief)
        local_stack.kill(brief, signal.SIGTERM)
