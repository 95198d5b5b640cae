"""Replica failure mid-generation: kill -9 of a target or a draft replica in the middle of
streams, an empty draft pool, an empty target pool.

The tests share one stack of two drafts and two targets and run in file order, each
leaving fewer replicas for the next (a test run alone starts what it lacks).
"""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from tests.e2e.helpers import Streams, api, live_replicas, load_report, redis_client, request, session_handles
from tests.stacks import started_stack, stopped

pytestmark = pytest.mark.e2e

PROMPTS = ["def parse(line):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef walk(root):\n",
           "for i in range(10):\n"]
NEW_TOKENS = 96
# the streams that a replica leaves mid-way draft a fixed γ: every round then calls both pools,
# where an adaptive one under load may be decoding target-only (the load governor) when the
# draft replica goes, and never call it again
GAMMA = 4
# long enough that no stream can finish before the signalled replica has gone, with room to
# spare as the forward gets faster (192 tokens took about a second a stream here in 2026-12)
LONG = 384


@pytest.fixture(scope="module")
def stack(bundled_paths):
    stack = started_stack(drafts=2, targets=2)
    yield stack
    stopped(stack)


def ensure(stack, kind: str, count: int) -> None:
    while len(live_replicas(stack, kind)) < count:
        stack.start_replica(kind)
    stack.wait_registered(*((count, 0) if kind == "draft" else (0, count)))


def references(stub, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy outputs of an undisturbed run, through the API."""
    return [list(stub.Generate(request(p, new_tokens, 0.0), timeout=120).token_ids) for p in prompts]


def kill_busiest(stack, streams: Streams, kind: str, sig: int = signal.SIGKILL) -> tuple[str, set[str]]:
    """Once every stream is under way, send `sig` to the replica of `kind` holding the most
    of their sessions and wait for it to exit; → (its address, the sessions it held)."""
    streams.wait_first_chunks()
    placed = {sid: h[kind] for sid, h in session_handles(stack).items()}
    victim = max(live_replicas(stack, kind), key=lambda r: sum(a == r.address for a in placed.values()))
    stack.kill(victim, sig)
    return victim.address, {sid for sid, a in placed.items() if a == victim.address}


def assert_failover_is_invisible(results, expected, killed: str, affected: set[str], kind: str) -> None:
    assert affected, "no stream was running on the killed replica: the test proved nothing"
    for result, want in zip(results, expected):
        assert not isinstance(result, grpc.RpcError), f"a stream failed: {result.code()} {result.details()}"
        tokens, last = result
        assert tokens == want, "the greedy output changed across the failover"
        if last.session_id in affected:
            assert last.stats.replica_failovers >= 1
            assert getattr(last.stats, f"{kind}_replica") != killed


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_replica_killed_mid_stream_is_invisible_to_clients(stack, kind):
    ensure(stack, kind, 2)
    stub = api(stack.orchestrator_address)
    expected = references(stub, new_tokens=LONG)
    streams = Streams(stub, [request(p, LONG, 0.0, gamma=GAMMA) for p in PROMPTS])
    killed, affected = kill_busiest(stack, streams, kind)
    assert_failover_is_invisible(streams.join(), expected, killed, affected, kind)


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_replica_stopped_mid_stream_hands_its_sessions_over(stack, kind):
    """SIGTERM (a rolling update): the replica ends each session's round stream after the
    message in flight, so the sessions move to the other replica at their next round
    instead of running on until the drain's grace cuts them off."""
    ensure(stack, kind, 2)
    stub = api(stack.orchestrator_address)
    expected = references(stub, new_tokens=LONG)
    streams = Streams(stub, [request(p, LONG, 0.0, gamma=GAMMA) for p in PROMPTS])
    stopped, affected = kill_busiest(stack, streams, kind, signal.SIGTERM)
    assert [r.proc.returncode for r in stack.replicas if r.address == stopped] == [0]
    assert_failover_is_invisible(streams.join(), expected, stopped, affected, kind)


def test_empty_draft_pool_falls_back_to_prompt_lookup_and_recovers(stack):
    ensure(stack, "draft", 1)
    stub = api(stack.orchestrator_address)
    expected = references(stub)
    streams = Streams(stub, [request(p, NEW_TOKENS, 0.0) for p in PROMPTS])
    streams.wait_first_chunks()
    for rep in live_replicas(stack, "draft"):
        stack.kill(rep)
    for result, want in zip(streams.join(), expected):
        assert not isinstance(result, grpc.RpcError), f"a stream failed: {result.code()} {result.details()}"
        assert result[0] == want
    # greedy sessions draft by prompt lookup meanwhile (orchestrator/ngram.py): the same answers
    after = stub.Generate(request(PROMPTS[0], NEW_TOKENS, 0.0), timeout=120)
    assert list(after.token_ids) == expected[0]
    assert after.stats.draft_replica == ""
    assert after.stats.lookup_drafted_tokens == after.stats.drafted_tokens > 0
    assert after.stats.target_forward_passes < NEW_TOKENS  # the lookups kept tokens
    # sampled sessions and a request for target-only decode target-only
    for req in (request(PROMPTS[0], 24, 1.0, seed=3), request(PROMPTS[0], 24, 0.0, gamma=0)):
        assert stub.Generate(req, timeout=120).stats.drafted_tokens == 0
    fixed = stub.Generate(request(PROMPTS[2], NEW_TOKENS, 0.0, gamma=2), timeout=120)
    assert list(fixed.token_ids) == expected[2] and fixed.stats.mean_gamma <= 2

    fresh = stack.start_replica("draft")
    deadline = time.monotonic() + 10
    while True:
        resumed = stub.Generate(request(PROMPTS[1], 24, 0.0), timeout=120)
        if resumed.stats.draft_replica or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert resumed.stats.drafted_tokens > resumed.stats.lookup_drafted_tokens, \
        "speculation did not resume with a draft replica back"
    assert resumed.stats.draft_replica == fresh.address
    assert list(resumed.token_ids) == expected[1][:24]


def test_sampled_sessions_look_up_under_all_and_keep_the_targets_law(stack, target_model, tokenizer):
    """`--prompt-lookup all`: with no draft replica, unseeded sampled sessions draft by prompt
    lookup, their draft law a point mass on each token (specdec.encoding.point_masses), and the
    first token out of such a round still has the target's law (chi-square over 600
    requests, both the looked-up token and others drawn); seeded ones never look up (their
    rounds must not hang on the load), nor ones saying prompt_lookup false. Under the
    default (greedy lookups) a sampled request that asks (prompt_lookup true) looks up, and
    a greedy one that says false does not, with the same answer."""
    import concurrent.futures as cf

    import torch

    from orchestrator.ngram import NgramIndex
    from tests.specdec.test_spec_loop import _chisq

    for rep in live_replicas(stack, "draft"):
        stack.kill(rep)
    # until their registry entries expire, a killed replica is still picked and its calls fail:
    # a fixed γ then decodes target-only, as it must (its draft is the one it measures)
    registry, deadline = redis_client(stack), time.monotonic() + 30
    while registry.keys("specdec:replica:draft:*") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not registry.keys("specdec:replica:draft:*")
    everyone = stack.start_orchestrator(extra=["--prompt-lookup", "all"])
    try:
        stub = api(everyone.address)
        prompt, temperature, n = "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1,", 1.5, 600
        ids = tokenizer(prompt)["input_ids"]
        guess = NgramIndex().propose(ids, 1)
        assert guess, "the prompt must repeat its own last tokens"

        def first(_):  # a fixed γ with no draft replica looks up that many, whatever the policy's price
            got = stub.Generate(request(prompt, 2, temperature, gamma=1), timeout=120)
            return got.token_ids[0], got.stats.lookup_drafted_tokens, got.stats.drafted_tokens

        with cf.ThreadPoolExecutor(16) as pool:
            runs = list(pool.map(first, range(n)))
        firsts = torch.tensor([t for t, _, _ in runs])
        assert all(looked == drafted for _, looked, drafted in runs)  # no draft replica drafted
        assert sum(looked for _, looked, _ in runs) == n  # the first round looked its token up
        kept = int((firsts == guess[0]).sum())
        assert 0 < kept < n, "both the looked-up token and others must have come out"
        with torch.no_grad():
            logits = target_model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        p = torch.softmax(logits / temperature, -1)
        assert _chisq(torch.bincount(firsts, minlength=p.shape[0]).double(), p) > 1e-3
        for seed in (1, 2):
            seeded = stub.Generate(request(prompt, 24, temperature, seed=seed), timeout=120)
            assert seeded.stats.drafted_tokens == 0
        assert stub.Generate(request(prompt, 24, temperature, prompt_lookup=False),
                             timeout=120).stats.drafted_tokens == 0  # asked not to
    finally:
        stack.kill(everyone, sig=15)
        stack.orchestrators.remove(everyone)
    # the default orchestrator (greedy lookups): a request decides for itself
    stub = api(stack.orchestrator_address)
    assert stub.Generate(request(prompt, 24, temperature), timeout=120).stats.drafted_tokens == 0
    asked = [stub.Generate(request(prompt, 24, temperature, prompt_lookup=True), timeout=120) for _ in range(4)]
    assert all(r.stats.lookup_drafted_tokens == r.stats.drafted_tokens for r in asked)
    assert sum(r.stats.lookup_drafted_tokens for r in asked) > 0
    greedy = stub.Generate(request(prompt, 24, 0.0, prompt_lookup=False), timeout=120)
    assert greedy.stats.drafted_tokens == 0
    assert list(greedy.token_ids) == list(stub.Generate(request(prompt, 24, 0.0), timeout=120).token_ids)


def test_empty_target_pool_is_unavailable_with_a_clear_message(stack):
    ensure(stack, "target", 1)
    stub = api(stack.orchestrator_address)
    streams = Streams(stub, [request(p, NEW_TOKENS, 0.0) for p in PROMPTS[:2]])
    streams.wait_first_chunks()
    for rep in live_replicas(stack, "target"):
        stack.kill(rep)
    for result in streams.join():
        assert isinstance(result, grpc.RpcError), "a stream finished with no target replica alive"
        assert result.code() == grpc.StatusCode.UNAVAILABLE
        assert "target" in result.details()
    for call in (lambda r: stub.Generate(r, timeout=30), lambda r: list(stub.GenerateStream(r, timeout=30))):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            call(request(PROMPTS[0], 8, 0.0))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live target replica" in err.value.details() and "pool 'target'" in err.value.details()
        assert time.monotonic() - t0 < 5
    for rep in live_replicas(stack, "draft"):  # the draft pool is untouched and idle again
        assert load_report(rep.address, "draft").sessions == 0
