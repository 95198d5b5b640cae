"""Prefix reuse through the stack (specdec/sessions.py): a new session whose prompt begins
with tokens another held or recently released session fed starts from a copy of them, on
both replicas, and answers as if it had computed them."""
from __future__ import annotations

import signal

import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import api, live_replicas, load_report, request, stream
from tests.e2e.test_pipeline import target_greedy

pytestmark = pytest.mark.e2e
SYSTEM = ("# You are a careful Python programmer. Answer with code only, typed, documented,\n"
          "# and tested; prefer the standard library.\n")


def fed(address: str, kind: str) -> int:
    return load_report(address, kind).prefill_tokens


def test_a_prompt_sharing_a_long_prefix_feeds_only_the_rest_and_answers_as_alone(local_stack, target_model,
                                                                                tokenizer):
    stub = api(local_stack.orchestrator_address)
    questions = ["def median(xs):\n", "class LRU:\n"]
    prompts = [SYSTEM + q for q in questions]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared > 16  # the system prompt's tokens, more than the reuse's minimum
    first = stub.Generate(request(prompts[0], 24, 0.0, gamma=4), timeout=120)
    draft, target = first.stats.draft_replica, first.stats.target_replica
    before = fed(draft, "draft"), fed(target, "target")
    # the first session is released by now: its cache stays a donor for the next
    second = stub.Generate(request(prompts[1], 24, 0.0, gamma=4), timeout=120)
    assert (second.stats.draft_replica, second.stats.target_replica) == (draft, target)
    target_fed = fed(target, "target") - before[1]
    # the prompt but its shared part, then each round's pending token and draft (without the
    # reuse, the whole prompt: `shared` tokens more than this bound allows)
    assert target_fed <= len(ids[1]) - shared + second.stats.drafted_tokens + second.stats.rounds
    for prompt, got, own in zip(prompts, (first, second), ids):
        assert list(got.token_ids) == target_greedy(target_model, own, 24, tokenizer.eos_token_id)
    # the same prompt again, streamed and sampled: the answers of a session computed afresh
    again, text, _ = stream(stub, request(prompts[1], 24, 0.0))
    assert again == list(second.token_ids) and text == second.text
    seeded = [stub.Generate(request(prompts[0], 24, 1.0, seed=5, prompt_logprobs=k == 0), timeout=120)
              for k in range(2)]  # the first asks every prompt row: it computes them all
    assert list(seeded[0].token_ids) == list(seeded[1].token_ids)
    assert len(seeded[0].prompt_logprobs) == len(ids[0]) - 1


def test_replicas_count_what_they_reuse_and_reuse_nothing_when_told_not_to(stack, tokenizer):
    """Both pools reuse the shared prefix (their Prometheus counters), and with
    --prefix-reuse off every new session feeds its whole prompt."""
    from localstack.stack import free_port, scrape_metrics

    prompts = [SYSTEM + q for q in ("def median(xs):\n", "class LRU:\n")]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    stub = api(stack.orchestrator_address)
    for reuse in ("off", "on"):
        old = live_replicas(stack, "draft") + live_replicas(stack, "target")
        for rep in old:  # drained and replaced side by side: each start loads a model
            rep.proc.send_signal(signal.SIGTERM)
        for rep in old:
            rep.proc.wait(30)
        ports = {kind: free_port() for kind in ("draft", "target")}
        fresh = [stack.start_replica(kind, wait=False, extra=["--prefix-reuse", reuse, "--metrics-port", str(port)])
                 for kind, port in ports.items()]
        for rep in fresh:
            stack.wait_serving(rep)
        stack.wait_registered(1, 1)
        answers = [stub.Generate(request(p, 8, 0.0, gamma=4), timeout=120) for p in prompts]
        fed = load_report(answers[1].stats.target_replica, "target").prefill_tokens
        # the whole prompts, then each round's pending token and draft
        whole = sum(len(i) for i in ids) + sum(a.stats.drafted_tokens + a.stats.rounds - 1 for a in answers)
        for kind, port in ports.items():
            metrics = scrape_metrics(port)
            reused = metrics.get(f'specdec_replica_reused_positions_total{{pool="{kind}"}}', 0.0)
            if reuse == "on":
                assert reused >= 16 and metrics[f'specdec_replica_prefix_reuses_total{{pool="{kind}"}}'] >= 1, kind
            else:
                assert reused == 0, kind
        assert (fed < whole) if reuse == "on" else (fed == whole)


def test_prompts_that_begin_alike_meet_on_one_target_of_two(stack, tokenizer):
    """With two target replicas, new sessions whose prompts share their start go to the
    same one (the orchestrator's prefix affinity), which then reuses the prefix."""
    stack.start_replica("target")
    stack.wait_registered(1, 2)
    targets = [r.address for r in live_replicas(stack, "target")]
    assert len(targets) == 2
    before = {t: fed(t, "target") for t in targets}
    stub = api(stack.orchestrator_address)
    prompts = [SYSTEM + q for q in ("def a():\n", "def b():\n", "class C:\n", "import os\n")]
    answers = [stub.Generate(request(p, 4, 0.0, gamma=0), timeout=120) for p in prompts]
    held = {a.stats.target_replica for a in answers}
    assert len(held) == 1
    (held,) = held
    whole = sum(len(tokenizer(p)["input_ids"]) + a.stats.rounds - 1 for p, a in zip(prompts, answers))
    assert fed(held, "target") - before[held] <= whole - 3 * 16  # three at least started from a copy


def test_sessions_moved_off_a_killed_target_meet_again_where_their_prefix_is(stack, target_model, tokenizer):
    """Failover places a moved session by its prompt's start too: two kept sessions sharing
    a system prompt, whose target is killed, go on together on one of the two left, where
    the second starts from the first's copy of that prompt."""
    while len(live_replicas(stack, "target")) < 3:
        stack.start_replica("target")
    stack.wait_registered(1, 3)
    stub = api(stack.orchestrator_address)
    prompts = [SYSTEM + q for q in ("def e():\n", "def f():\n")]
    firsts = [stub.Generate(request(p, 4, 0.0, gamma=0, keep_session=True), timeout=120) for p in prompts]
    (held,) = {a.stats.target_replica for a in firsts}
    stack.kill(next(r for r in live_replicas(stack, "target") if r.address == held))
    others = [r.address for r in live_replicas(stack, "target")]
    before = {t: fed(t, "target") for t in others}
    seconds = [stub.Generate(request("", 4, 0.0, gamma=0, session_id=a.session_id, keep_session=True), timeout=120)
               for a in firsts]
    (moved,) = {a.stats.target_replica for a in seconds}
    assert moved in others
    contexts = [tokenizer(p)["input_ids"] + list(a.token_ids) for p, a in zip(prompts, firsts)]
    for context, got in zip(contexts, seconds):
        assert list(got.token_ids) == target_greedy(target_model, context, 4, tokenizer.eos_token_id)
    # each whole context and its rounds' tokens, less at least 16 of the second's (a copy)
    whole = sum(len(c) + a.stats.rounds - 1 for c, a in zip(contexts, seconds))
    assert fed(moved, "target") - before[moved] <= whole - 16
    for a in seconds:
        stub.EndSession(pb.EndSessionRequest(session_id=a.session_id), timeout=30)
