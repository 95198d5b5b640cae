"""Replicas that stop answering without failing (a pause, a hang, a queue far too long).

A draft replica costs a generation one short wait (`--draft-wait-ms`, 250 ms by default),
not the stall: its rounds go on target-only, exact as ever, the other generations skip that
replica until it answers, and speculation comes back once it does. A seeded sampled request
waits the stall out instead, because its tokens depend on where its rounds end and it must
reproduce. A target replica holds its sessions for `--call-timeout`, then they move to
another target.

A replica is paused with SIGSTOP (its process stays, its sockets stay open, it just does
not answer) and resumed with SIGCONT; a timer resumes it in any case.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import grpc
import pytest

from localstack.stack import free_port, scrape_metrics
from tests.e2e.helpers import Streams, api, live_replicas, request, session_handles
from tests.stacks import started_stack, stopped

pytestmark = pytest.mark.e2e

PROMPTS = ["def parse(line):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef walk(root):\n"]
NEW_TOKENS = 48
LONG = 384  # a stream still under way when its draft replica is paused after the first chunk
PAUSE_S = 60.0  # the pause, unless a test ends it sooner: far beyond what a generation may take here
# what a generation may take while its draft replica is paused: its wait for the draft,
# then target-only rounds (well under a second here), with room for a slow CI machine
BOUND_S = 12.0


CALL_MODES = ("frames", "stream")  # the default, and a generation's own stream to each replica
CALL_TIMEOUT_S = 2.0
ORCHESTRATORS = {  # name → flags
    "frames": [], "stream": ["--internal-calls", "stream"], "short": ["--call-timeout", str(CALL_TIMEOUT_S)],
    "no-lookup": ["--prompt-lookup", "off"]}


@pytest.fixture(scope="module")
def stack(bundled_paths):
    """One draft, two targets, and an orchestrator for each of `ORCHESTRATORS`, each with
    its metrics."""
    stack = started_stack(drafts=1, targets=2, orchestrators=0)
    stack.metrics_ports = {}
    try:
        for name, flags in ORCHESTRATORS.items():  # started side by side, then waited for
            stack.metrics_ports[name] = free_port()
            stack.start_orchestrator(extra=["--metrics-port", str(stack.metrics_ports[name]), *flags], wait=False)
        for rep in stack.orchestrators:
            stack.wait_serving(rep)
    except BaseException:
        stopped(stack)
        raise
    yield stack
    stopped(stack)


def orchestrator(stack, name: str = "frames"):
    """→ (the API of orchestrator `name`, a function reading its late draft calls so far)."""
    address = stack.orchestrators[list(ORCHESTRATORS).index(name)].address
    return api(address), lambda: scrape_metrics(stack.metrics_ports[name]).get("specdec_draft_late_total", 0.0)


@contextmanager
def paused(replica, resume_after: float = PAUSE_S):
    pid = replica.proc.pid
    resume = threading.Timer(resume_after, os.kill, (pid, signal.SIGCONT))
    os.kill(pid, signal.SIGSTOP)
    resume.start()
    try:
        yield
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)


def speculating_again(stub, prompt: str, timeout: float = 20.0):
    """The first greedy generation that drafted again once the replica answers."""
    deadline = time.monotonic() + timeout
    while True:
        r = stub.Generate(request(prompt, NEW_TOKENS, 0.0), timeout=60)
        if r.stats.drafted_tokens > r.stats.lookup_drafted_tokens or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


@pytest.mark.parametrize("mode", CALL_MODES)
def test_a_paused_draft_costs_a_generation_the_wait_not_the_pause(stack, mode):
    stub, late_calls = orchestrator(stack, mode)
    [draft] = live_replicas(stack, "draft")
    expected = {p: list(stub.Generate(request(p, NEW_TOKENS, 0.0, gamma=0), timeout=60).token_ids) for p in PROMPTS}
    assert stub.Generate(request(PROMPTS[0], NEW_TOKENS, 0.0), timeout=60).stats.drafted_tokens > 0
    before, looked_up = late_calls(), lookups(stack, mode)
    with paused(draft):
        t0 = time.monotonic()
        for prompt in PROMPTS[:2]:
            r = stub.Generate(request(prompt, NEW_TOKENS, 0.0), timeout=60)
            assert list(r.token_ids) == expected[prompt], "rounds without the draft changed the greedy output"
            assert r.stats.draft_replica == draft.address  # the replica was picked, not missing from the pool
            assert r.stats.drafted_tokens == r.stats.lookup_drafted_tokens  # prompt lookup's only
            looked_up += r.stats.lookup_drafted_tokens
        took = time.monotonic() - t0
        late = late_calls() - before
    assert lookups(stack, mode) == looked_up  # the orchestrator's counter
    assert took < BOUND_S, f"two generations took {took:.1f}s beside a paused draft replica"
    # the second generation skipped the replica that still owed the first its call
    assert late == 1
    r = speculating_again(stub, PROMPTS[2])
    assert r.stats.drafted_tokens > r.stats.lookup_drafted_tokens, \
        "speculation did not come back once the draft replica answered"
    assert list(r.token_ids) == expected[PROMPTS[2]]


def lookups(stack, name: str) -> float:
    return scrape_metrics(stack.metrics_ports[name]).get("specdec_lookup_drafted_tokens_total", 0.0)


def test_without_prompt_lookup_a_paused_draft_leaves_rounds_target_only(stack):
    stub, late_calls = orchestrator(stack, "no-lookup")
    [draft] = live_replicas(stack, "draft")
    want = list(stub.Generate(request(PROMPTS[0], NEW_TOKENS, 0.0, gamma=0), timeout=60).token_ids)
    with paused(draft):
        r = stub.Generate(request(PROMPTS[0], NEW_TOKENS, 0.0), timeout=60)
    assert list(r.token_ids) == want and r.stats.drafted_tokens == 0
    assert lookups(stack, "no-lookup") == 0


def test_a_draft_paused_mid_stream_leaves_the_stream_on_target_only(stack):
    stub, late_calls = orchestrator(stack)
    [draft] = live_replicas(stack, "draft")
    want = list(stub.Generate(request(PROMPTS[1], LONG, 0.0, gamma=0), timeout=60).token_ids)
    before = late_calls()
    streams = Streams(stub, [request(PROMPTS[1], LONG, 0.0, gamma=4)])  # a fixed γ calls the draft every round
    streams.wait_first_chunks()
    with paused(draft):
        t0 = time.monotonic()
        [result] = streams.join(timeout=BOUND_S)
        took = time.monotonic() - t0
    assert not isinstance(result, grpc.RpcError), f"the stream failed: {result.code()} {result.details()}"
    tokens, last = result
    assert tokens == want
    assert late_calls() - before == 1, "the stream was not left waiting on its paused draft"
    assert last.stats.drafted_tokens > 0 and last.stats.replica_failovers == 0
    assert took < BOUND_S
    again = speculating_again(stub, PROMPTS[0]).stats
    assert again.drafted_tokens > again.lookup_drafted_tokens


def test_a_seeded_sampled_request_waits_for_its_draft_and_reproduces(stack):
    """Even while another generation has found the replica stalled."""
    stub, _ = orchestrator(stack)
    [draft] = live_replicas(stack, "draft")
    seeded = request(PROMPTS[2], NEW_TOKENS, 1.0, seed=1234)
    want = stub.Generate(seeded, timeout=60)
    assert want.stats.drafted_tokens > 0
    resume_after = 2.0
    with paused(draft, resume_after=resume_after):
        t0 = time.monotonic()
        stub.Generate(request(PROMPTS[0], NEW_TOKENS, 0.0), timeout=60)  # finds the replica late
        got = stub.Generate(seeded, timeout=60)
        took = time.monotonic() - t0
    assert took >= resume_after - 0.1, "the seeded request did not wait for its draft"
    assert list(got.token_ids) == list(want.token_ids)
    assert got.stats.drafted_tokens == want.stats.drafted_tokens and got.stats.rounds == want.stats.rounds


def test_a_paused_target_is_left_after_the_call_timeout(stack):
    """A target replica that hangs without failing holds its sessions for `--call-timeout`,
    then counts as down: they move to the other target, their caches rebuilt there, and the
    stream goes on with the same tokens."""
    stub, _ = orchestrator(stack, "short")
    want = list(stub.Generate(request(PROMPTS[0], LONG, 0.0, gamma=0), timeout=60).token_ids)
    streams = Streams(stub, [request(PROMPTS[0], LONG, 0.0)])
    streams.wait_first_chunks()
    [held] = {handle["target"] for handle in session_handles(stack).values()}
    [target] = [r for r in live_replicas(stack, "target") if r.address == held]
    with paused(target):
        t0 = time.monotonic()
        [result] = streams.join(timeout=BOUND_S + CALL_TIMEOUT_S)
        took = time.monotonic() - t0
    assert not isinstance(result, grpc.RpcError), f"the stream failed: {result.code()} {result.details()}"
    tokens, last = result
    assert tokens == want
    assert last.stats.replica_failovers >= 1 and last.stats.target_replica not in ("", held)
    assert CALL_TIMEOUT_S - 0.5 < took < BOUND_S + CALL_TIMEOUT_S
