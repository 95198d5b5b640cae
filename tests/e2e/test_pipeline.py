"""The distributed pipeline through the public API, against a real Redis, real gRPC
servers on loopback and the bundled models."""
from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import api, load_report, redis_client, request, session_keys, stream
from tests.specdec.test_spec_loop import _chisq

pytestmark = pytest.mark.e2e


def target_greedy(target_model, ids, n, eos):
    out = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def test_greedy_through_the_api_matches_the_target_alone(local_stack, target_model, tokenizer, heldout_prompts):
    stub = api(local_stack.orchestrator_address)
    for prompt in heldout_prompts[:6]:
        ids = tokenizer(prompt)["input_ids"]
        expected = target_greedy(target_model, ids, 48, tokenizer.eos_token_id)
        unary = stub.Generate(request(prompt, 48, 0.0), timeout=120)
        streamed, text, last = stream(stub, request(prompt, 48, 0.0))
        target_only = stub.Generate(request(prompt, 48, 0.0, gamma=0), timeout=120)
        fixed = stub.Generate(request(prompt, 48, 0.0, gamma=4), timeout=120)
        assert list(unary.token_ids) == expected
        assert streamed == expected and text == unary.text
        assert list(target_only.token_ids) == expected and target_only.stats.drafted_tokens == 0
        assert list(fixed.token_ids) == expected
        assert fixed.stats.target_forward_passes < len(expected)  # speculation saved passes
        assert last.stats.generated_tokens == len(expected)


def test_seeded_sampling_is_reproducible(local_stack):
    stub = api(local_stack.orchestrator_address)
    a = stub.Generate(request("class Node:\n", 40, 1.0, seed=1234, top_p=0.95), timeout=120)
    b = stub.Generate(request("class Node:\n", 40, 1.0, seed=1234, top_p=0.95), timeout=120)
    c = stub.Generate(request("class Node:\n", 40, 1.0, seed=1235, top_p=0.95), timeout=120)
    assert list(a.token_ids) == list(b.token_ids)
    assert list(a.token_ids) != list(c.token_ids)
    assert a.stats.seed == 1234


def test_first_token_distribution_through_the_api_is_the_targets(local_stack, target_model, tokenizer):
    stub = api(local_stack.orchestrator_address)
    prompt = "    def __init__(self, "
    ids = tokenizer(prompt)["input_ids"]
    n = 600

    def first(seed):
        r = stub.Generate(request(prompt, 2, 1.0, gamma=3, seed=seed), timeout=120)
        return r.token_ids[0]

    with cf.ThreadPoolExecutor(16) as pool:
        firsts = list(pool.map(first, range(n)))
    with torch.no_grad():
        p = torch.softmax(target_model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
    observed = torch.bincount(torch.tensor(firsts), minlength=p.shape[0]).double()
    assert _chisq(observed, p) > 1e-3


def test_sessions_continue_without_reprefill_and_handles_are_cleaned(local_stack, tokenizer):
    stub = api(local_stack.orchestrator_address)
    first = stub.Generate(request("def add(a, b):\n", 16, 0.0, keep_session=True), timeout=120)
    sid = first.session_id
    assert sid in session_keys(local_stack)
    target = first.stats.target_replica
    before = load_report(target, "target").prefill_tokens
    follow = "\n\ndef sub(a, b):\n"
    second = stub.Generate(request(follow, 16, 0.0, session_id=sid), timeout=120)
    fed = load_report(target, "target").prefill_tokens - before
    # only the new prompt, the last token of the previous call and the drafts were fed
    assert fed <= len(tokenizer(follow)["input_ids"]) + 1 + second.stats.drafted_tokens + second.stats.rounds
    assert second.session_id == sid and second.stats.target_replica == target
    stub.EndSession(pb.EndSessionRequest(session_id=sid))
    assert sid not in session_keys(local_stack)
    ephemeral = stub.Generate(request("x = 1\n", 8, 0.0), timeout=120)
    assert ephemeral.session_id not in session_keys(local_stack)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request("more", 4, 0.0, session_id=sid), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_second_orchestrator_continues_a_session(local_stack, target_model, tokenizer):
    other = local_stack.start_orchestrator()
    try:
        stub_a, stub_b = api(local_stack.orchestrator_address), api(other.address)
        prompt = "def fib(n):\n"
        first = stub_a.Generate(request(prompt, 12, 0.0, keep_session=True), timeout=120)
        second = stub_b.Generate(request("", 12, 0.0, session_id=first.session_id), timeout=120)
        ids = tokenizer(prompt)["input_ids"]
        expected = target_greedy(target_model, ids, 24, tokenizer.eos_token_id)
        assert list(first.token_ids) + list(second.token_ids) == expected
        stub_b.EndSession(pb.EndSessionRequest(session_id=first.session_id))
    finally:
        local_stack.kill(other, sig=15)
        local_stack.orchestrators.remove(other)


def test_the_servers_run_on_uvloop_by_default(local_stack):
    """The shared stack's servers take the default `--event-loop auto`: uvloop's loop, which
    requirements.txt installs (tests/e2e/test_cancellation.py runs a stack on asyncio's)."""
    logs = {path.name: path.read_text(errors="replace") for path in local_stack.workdir.glob("*.log")
            if not path.name.startswith("redis")}
    serving = [line for log in logs.values() for line in log.splitlines() if " serving on " in line]
    assert len(serving) >= 3 and all(line.endswith(("event loop uvloop", "event loop uvloop)")) for line in serving)


def test_health_and_reflection(local_stack):
    channel = grpc.insecure_channel(local_stack.orchestrator_address)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Orchestrator"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"specdec.v1.Orchestrator", "grpc.health.v1.Health"} <= names
    for rep in local_stack.replicas:
        ch = grpc.insecure_channel(rep.address)
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_replicas_are_in_the_registry(local_stack):
    r = redis_client(local_stack)
    members = {m.decode() for m in r.smembers("specdec:pool:draft")} | {m.decode() for m in r.smembers("specdec:pool:target")}
    assert {rep.address for rep in local_stack.replicas} <= members


def test_overlapped_drafting_keeps_the_output_exact(local_stack, target_model, tokenizer, heldout_prompts):
    """An orchestrator that pre-drafts every round (--overlap-min-hit 0; no prompt lookup,
    whose rounds leave nothing to pre-draft from): greedy output is still the target's own,
    pre-drafts were used, greedy and at temperature 1, and a seeded sampled request, which
    never pre-drafts (orchestrator/predraft.py), reproduces."""
    eager = local_stack.start_orchestrator(extra=["--overlap-min-hit", "0", "--prompt-lookup", "off"])
    try:
        stub = api(eager.address)
        hits = 0
        for prompt in heldout_prompts[6:10]:
            ids = tokenizer(prompt)["input_ids"]
            expected = target_greedy(target_model, ids, 48, tokenizer.eos_token_id)
            r = stub.Generate(request(prompt, 48, 0.0), timeout=120)
            assert list(r.token_ids) == expected
            hits += r.stats.overlap_hits
        assert hits > 0, "no pre-drafted round was ever used"
        a = stub.Generate(request("def run(self):\n", 40, 1.0, seed=77), timeout=120)
        b = stub.Generate(request("def run(self):\n", 40, 1.0, seed=77), timeout=120)
        assert list(a.token_ids) == list(b.token_ids)
        assert a.stats.overlap_hits == b.stats.overlap_hits == 0
        # at temperature 1 the draft guesses the bonus under the target's own noise
        # (sampling.bonus_guess_rows), so pre-drafts get used there too
        sampled = [stub.Generate(request(p, 40, 1.0), timeout=120) for p in heldout_prompts[6:10]]
        assert sum(r.stats.overlap_hits for r in sampled) > 0
    finally:
        local_stack.kill(eager, sig=15)
        local_stack.orchestrators.remove(eager)



@pytest.mark.parametrize("calls", ["mux", "unary"])
def test_forked_pre_drafts_keep_greedy_output_exact(local_stack, target_model, tokenizer, heldout_prompts, calls):
    """An orchestrator that forks on every likely rejection (--overlap-forks 8): greedy
    output is still the target's own, forks were started and some were used, over
    multiplexed streams and over unary calls (where a wasted fork is cancelled)."""
    from localstack.stack import free_port, scrape_metrics

    port = free_port()
    forking = local_stack.start_orchestrator(extra=["--overlap-forks", "8", "--internal-calls", calls,
                                                    "--metrics-port", str(port)])
    try:
        stub = api(forking.address)
        for prompt in heldout_prompts[6:10]:
            ids = tokenizer(prompt)["input_ids"]
            expected = target_greedy(target_model, ids, 48, tokenizer.eos_token_id)
            assert list(stub.Generate(request(prompt, 48, 0.0), timeout=120).token_ids) == expected
        metrics = scrape_metrics(port)
        assert metrics['specdec_overlap_total{outcome="fork"}'] > 0
        assert metrics.get('specdec_overlap_total{outcome="fork_hit"}', 0) > 0, "no fork was ever used"
    finally:
        local_stack.kill(forking, sig=15)
        local_stack.orchestrators.remove(forking)

def test_unary_internal_calls_give_the_same_tokens_as_round_streams(local_stack):
    """--internal-calls unary (one unary call per request, no streams) is the same loop:
    greedy and seeded fixed-γ sampling give the streams' tokens, with no stream opened."""
    from localstack.stack import free_port, scrape_metrics

    port = free_port()
    unary = local_stack.start_orchestrator(extra=["--internal-calls", "unary", "--metrics-port", str(port)])
    try:
        by_streams, by_unary = api(local_stack.orchestrator_address), api(unary.address)
        for temperature, gamma in ((0.0, None), (1.0, 3)):
            req = request("def tokens(text):\n", 32, temperature, gamma=gamma, seed=5)
            a, b = by_streams.Generate(req, timeout=120), by_unary.Generate(req, timeout=120)
            assert list(a.token_ids) == list(b.token_ids) and b.stats.drafted_tokens > 0
        metrics = scrape_metrics(port)
        assert not any(k.startswith("specdec_internal_streams_opened_total{") for k in metrics)
        assert metrics["specdec_rounds_total"] > 0
    finally:
        local_stack.kill(unary, sig=15)
        local_stack.orchestrators.remove(unary)


def test_the_confidence_stop_keeps_the_output_exact(local_stack, target_model, tokenizer, heldout_prompts):
    """An orchestrator whose adaptive proposals stop early where the draft is unsure
    (--stop-below-greedy/--stop-below-sampled 0.5, far more often than the defaults):
    greedy output is still the target's own, seeded sampling still reproducible, and
    proposals were cut."""
    from localstack.stack import free_port, scrape_metrics

    port = free_port()
    eager = local_stack.start_orchestrator(extra=["--stop-below-greedy", "0.5", "--stop-below-sampled", "0.5",
                                                  "--metrics-port", str(port)])
    try:
        stub = api(eager.address)
        for prompt in heldout_prompts[10:13]:
            ids = tokenizer(prompt)["input_ids"]
            r = stub.Generate(request(prompt, 48, 0.0), timeout=120)
            assert list(r.token_ids) == target_greedy(target_model, ids, 48, tokenizer.eos_token_id)
        stops = scrape_metrics(port)["specdec_draft_stops_total"]
        assert stops > 0, "no proposal was ever cut"
        a = stub.Generate(request("def run(self):\n", 40, 1.0, seed=78), timeout=120)
        b = stub.Generate(request("def run(self):\n", 40, 1.0, seed=78), timeout=120)
        assert list(a.token_ids) == list(b.token_ids)
        stops_after = scrape_metrics(port)["specdec_draft_stops_total"]
        assert stops_after > stops  # sampled proposals were cut too
        for prompt in heldout_prompts[10:13]:  # a fixed γ asked for is drafted in full
            stub.Generate(request(prompt, 48, 0.0, gamma=4), timeout=120)
        assert scrape_metrics(port)["specdec_draft_stops_total"] == stops_after
    finally:
        local_stack.kill(eager, sig=15)
        local_stack.orchestrators.remove(eager)


def test_greedy_rounds_look_up_where_that_beats_the_draft_and_answer_as_the_target(local_stack, target_model,
                                                                                   tokenizer):
    """With the draft replica up, adaptive greedy rounds on text that repeats look their
    draft up (orchestrator/ngram.py) where that is worth more than the draft's; the answer
    is still the target's own greedy one, streamed as unary, and a fixed γ never looks up."""
    stub = api(local_stack.orchestrator_address)
    prompts = ["def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):\n",
               "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2, 3]\n", "for i in range(3):\n    print(i)\n" * 3]
    looked_up = 0
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        got = stub.Generate(request(prompt, 64, 0.0), timeout=120)
        assert list(got.token_ids) == target_greedy(target_model, ids, 64, tokenizer.eos_token_id)
        assert got.stats.draft_replica  # the draft was there to draft
        looked_up += got.stats.lookup_drafted_tokens
        streamed, _, last = stream(stub, request(prompt, 64, 0.0))
        assert streamed == list(got.token_ids)
        fixed = stub.Generate(request(prompt, 32, 0.0, gamma=3), timeout=120)
        assert fixed.stats.lookup_drafted_tokens == 0 and list(fixed.token_ids) == list(got.token_ids)[:32]
    assert looked_up > 0
