"""Log-probabilities through the whole stack (specdec/logprobs.py): each new token's, and
the most likely alternatives, are those of a plain forward of the bundled target over the
prompt and the answer, whatever the request sampled with, unary or streamed, speculating
or not; asking for them changes no token."""
from __future__ import annotations

import grpc
import pytest
import torch

from specdec.sampling import SamplingParams, logits_to_probs
from specdec.v1 import orchestrator_pb2 as pb
from orchestrator.request_ids import session_for
from tests.e2e.helpers import api, redis_client, request
from tests.e2e.test_request_ids import cut_after_first_chunk, retried, rid

pytestmark = pytest.mark.e2e


def target_logprobs(model, tokens: list[int], start: int) -> torch.Tensor:
    """The log-softmax rows that predict tokens[start:], by the target alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[start - 1:len(tokens) - 1]


def check_against_the_target(model, prompt_ids: list[int], tokens: list[int], logprobs, top: int) -> None:
    assert [item.token_id for item in logprobs] == tokens
    rows = target_logprobs(model, prompt_ids + tokens, len(prompt_ids))
    got = torch.tensor([item.logprob for item in logprobs])
    assert torch.allclose(got, rows[torch.arange(len(tokens)), torch.tensor(tokens)], atol=2e-3)
    for item, row in zip(logprobs, rows):
        assert len(item.top) == top
        if top:
            values, ids = row.topk(top)
            assert [t.token_id for t in item.top][:2] == ids.tolist()[:2]  # ties past the first may swap
            assert torch.allclose(torch.tensor([t.logprob for t in item.top]), values, atol=2e-3)


CASES = {"greedy_adaptive": dict(temperature=0.0), "seeded_gamma4": dict(temperature=1.0, gamma=4, seed=5),
         "target_only": dict(temperature=0.8, gamma=0, seed=3), "top_k": dict(temperature=1.0, top_k=5, seed=9)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_answer_s_logprobs_are_the_target_s_and_change_no_token(local_stack, target_model, tokenizer, case):
    stub = api(local_stack.orchestrator_address)
    prompt = "def parse(line):\n    "
    plain = stub.Generate(request(prompt, 48, **CASES[case]), timeout=120)
    assert not plain.logprobs
    asked = stub.Generate(request(prompt, 48, **CASES[case], logprobs=True, top_logprobs=4), timeout=120)
    if "seed" in CASES[case] or CASES[case]["temperature"] == 0:
        assert list(asked.token_ids) == list(plain.token_ids)
    check_against_the_target(target_model, tokenizer(prompt)["input_ids"], list(asked.token_ids), asked.logprobs, 4)
    if CASES[case]["temperature"] == 0:  # greedy: each token is the likeliest, its logprob the top one's
        assert all(item.top[0].token_id == item.token_id for item in asked.logprobs)


def test_a_stream_s_chunks_carry_their_tokens_logprobs_cut_with_them_at_a_stop(local_stack, target_model,
                                                                              tokenizer):
    stub = api(local_stack.orchestrator_address)
    prompt = "def main():\n"
    whole = stub.Generate(request(prompt, 64, temperature=0.0, logprobs=True), timeout=120)
    text = whole.text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # ends the answer mid-round, most likely
    chunks = list(stub.GenerateStream(request(prompt, 64, temperature=0.0, logprobs=True, stop=[stop]), timeout=120))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    tokens = [t for c in chunks for t in c.token_ids]
    for chunk in chunks:
        assert [item.token_id for item in chunk.logprobs] == list(chunk.token_ids)
    logprobs = [item for c in chunks for item in c.logprobs]
    assert tokens == list(whole.token_ids[:len(tokens)]) and len(tokens) < len(whole.token_ids)
    check_against_the_target(target_model, tokenizer(prompt)["input_ids"], tokens, logprobs, 0)
    assert torch.allclose(torch.tensor([item.logprob for item in logprobs]),
                          torch.tensor([item.logprob for item in whole.logprobs[:len(tokens)]]), atol=1e-4)


def test_a_kept_session_s_logprobs_condition_on_its_history(local_stack, target_model, tokenizer):
    stub = api(local_stack.orchestrator_address)
    first = stub.Generate(request("class Stack:\n", 24, keep_session=True), timeout=120)
    second = stub.Generate(request("\n    def push(self, x):", 24, session_id=first.session_id, logprobs=True,
                                   top_logprobs=1), timeout=120)
    stub.EndSession(pb.EndSessionRequest(session_id=first.session_id))
    history = tokenizer("class Stack:\n")["input_ids"] + list(first.token_ids) + \
        tokenizer("\n    def push(self, x):")["input_ids"]
    check_against_the_target(target_model, history, list(second.token_ids), second.logprobs, 1)


@pytest.mark.parametrize("case", ["sampled", "greedy"])
def test_processed_logprobs_are_those_of_the_law_the_tokens_were_drawn_from(local_stack, target_model, tokenizer,
                                                                           case):
    """With processed_logprobs, the answer's and the prompt's numbers are the log of the
    sampled law over a plain forward of the target (temperature, top-k, top-p, min-p
    applied; −inf outside it; greedy: 0 at the likeliest token), and the tokens are those
    of the same request asking for raw ones."""
    stub = api(local_stack.orchestrator_address)
    prompt = "def parse(line):\n    "
    law = (dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05, seed=12) if case == "sampled"
           else dict(temperature=0.0))
    raw = stub.Generate(request(prompt, 40, **law, logprobs=True), timeout=120)
    done = stub.Generate(request(prompt, 40, **law, logprobs=True, top_logprobs=3, prompt_logprobs=True,
                                 processed_logprobs=True), timeout=120)
    assert list(done.token_ids) == list(raw.token_ids)
    ids = tokenizer(prompt)["input_ids"]
    text = ids + list(done.token_ids)
    with torch.no_grad():
        logits = target_model(input_ids=torch.tensor([text])).logits[0, :-1].float()
    params = SamplingParams(law["temperature"], law.get("top_k", 0), law.get("top_p", 1.0), 0, law.get("min_p", 0.0))
    rows = torch.log(logits_to_probs(logits, params))
    tokens = torch.tensor(text[1:])
    want = rows[torch.arange(len(tokens)), tokens]
    got = torch.tensor([x.logprob for x in list(done.prompt_logprobs) + list(done.logprobs)])
    assert torch.isfinite(got[-len(done.token_ids):]).all()  # a drawn token lies in its law
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(want)], want[torch.isfinite(want)], atol=2e-3)
    if case == "greedy":
        assert all(x.logprob == 0.0 for x in done.logprobs)
    else:  # not the raw numbers: the law is cut and sharpened
        assert not close(done.logprobs, raw.logprobs)
    top = torch.tensor([[t.logprob for t in x.top] for x in done.logprobs])
    values = rows[-len(done.token_ids):].topk(3, dim=-1).values
    assert torch.equal(torch.isinf(top), torch.isinf(values))
    assert torch.allclose(top[torch.isfinite(top)], values[torch.isfinite(values)], atol=2e-3)


@pytest.mark.parametrize("fields, says", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs must lie in 0..20"),
    (dict(top_logprobs=3), "top_logprobs needs logprobs or prompt_logprobs"),
    (dict(processed_logprobs=True), "processed_logprobs needs logprobs or prompt_logprobs"),
])
def test_bad_logprob_fields_are_refused_clearly(local_stack, fields, says):
    stub = api(local_stack.orchestrator_address)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request("x", 4, **fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()


def close(a, b) -> bool:
    return torch.allclose(torch.tensor([x.logprob for x in a]), torch.tensor([x.logprob for x in b]), atol=1e-4)


def test_a_retried_request_sends_the_logprobs_its_cut_attempt_committed_again(local_stack, target_model, tokenizer):
    """A cut stream retried with its id: the resumed tokens come with the log-probabilities
    stored beside them, the answer's are the uninterrupted call's, the prompt's those the
    cut attempt stored, and a whole answer's second retry gets them all again; where they
    are no longer kept, it says so."""
    stub = api(local_stack.orchestrator_address)
    prompt = "import os\n\ndef walk("
    reference = stub.Generate(request(prompt, 200, logprobs=True, top_logprobs=2, prompt_logprobs=True), timeout=120)
    req = request(prompt, 200, logprobs=True, top_logprobs=2, prompt_logprobs=True, request_id=rid())
    received = cut_after_first_chunk(stub, req)
    again = retried(stub, req)
    assert 0 < again.stats.resumed_tokens < len(again.token_ids)
    assert list(again.token_ids) == list(reference.token_ids) and again.token_ids[:len(received)] == received
    assert close(again.logprobs, reference.logprobs)
    assert close(again.prompt_logprobs, reference.prompt_logprobs)  # stored by the cut attempt
    check_prompt(target_model, [], tokenizer(prompt)["input_ids"], again.prompt_logprobs, top=2)
    assert [[t.token_id for t in x.top][:1] for x in again.logprobs] == \
        [[t.token_id for t in x.top][:1] for x in reference.logprobs]
    check_against_the_target(target_model, tokenizer(prompt)["input_ids"], list(again.token_ids), again.logprobs, 2)
    whole = stub.Generate(req, timeout=120)
    assert whole.stats.resumed_tokens == len(whole.token_ids) and close(whole.logprobs, reference.logprobs)
    assert close(whole.prompt_logprobs, reference.prompt_logprobs)
    store = redis_client(local_stack)
    keys = store.keys(f"specdec:session:{session_for(req.request_id)}:logprobs:*")
    assert len(keys) == 1 and store.ttl(keys[0]) > 0
    store.delete(*keys)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(req, timeout=120)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no longer kept" in err.value.details()
    stub.EndSession(pb.EndSessionRequest(session_id=session_for(req.request_id)), timeout=30)
    assert not store.keys(f"specdec:session:{session_for(req.request_id)}*")


def check_prompt(model, history: list[int], appended: list[int], got, top: int = 0, atol: float = 2e-3) -> None:
    """The prompt's log-probabilities: one per appended token but a new session's first."""
    first = 1 if not history else 0
    tokens = history + appended
    assert [item.token_id for item in got] == appended[first:]
    rows = target_logprobs(model, tokens, len(history) + first)
    want = rows[torch.arange(len(got)), torch.tensor(appended[first:])]
    assert torch.allclose(torch.tensor([item.logprob for item in got]), want, atol=atol), \
        (torch.tensor([item.logprob for item in got]) - want).abs().max()
    for item, row in zip(got, rows):
        assert len(item.top) == top
        if top:
            assert item.top[0].token_id == int(row.argmax())


def test_prompt_logprobs_are_the_target_s_for_every_prompt_token_unary_and_streamed(local_stack, target_model,
                                                                                   tokenizer):
    stub = api(local_stack.orchestrator_address)
    prompt = "def parse(line):\n    fields = line.split(',')\n"
    ids = tokenizer(prompt)["input_ids"]
    plain = stub.Generate(request(prompt, 24), timeout=120)
    asked = stub.Generate(request(prompt, 24, prompt_logprobs=True, top_logprobs=3), timeout=120)
    assert list(asked.token_ids) == list(plain.token_ids) and not asked.logprobs and not plain.prompt_logprobs
    check_prompt(target_model, [], ids, asked.prompt_logprobs, top=3)
    chunks = list(stub.GenerateStream(request(prompt, 24, prompt_logprobs=True, logprobs=True), timeout=120))
    assert all(not c.prompt_logprobs for c in chunks[:-1])
    check_prompt(target_model, [], ids, chunks[-1].prompt_logprobs)
    check_against_the_target(target_model, ids, [t for c in chunks for t in c.token_ids],
                             [x for c in chunks for x in c.logprobs], 0)


def test_a_long_prompt_fed_in_chunks_is_scored_across_their_boundaries(local_stack, target_model, tokenizer):
    """A prompt of about 700 tokens reaches the target as calls of 256 tokens: the token
    that begins each call is scored too (its call feeds from the token before)."""
    stub = api(local_stack.orchestrator_address)
    ids = tokenizer("import os\n" + "".join(f"value_{i} = compute({i}, {i * 7 % 13})\n" for i in range(60)))["input_ids"]
    assert len(ids) > 600
    asked = stub.Generate(request("", 8, prompt_token_ids=ids, prompt_logprobs=True), timeout=120)
    check_prompt(target_model, [], ids, asked.prompt_logprobs, atol=5e-3)


def test_a_kept_session_s_next_prompt_is_scored_from_its_history(local_stack, target_model, tokenizer):
    stub = api(local_stack.orchestrator_address)
    first = stub.Generate(request("class Stack:\n", 16, keep_session=True), timeout=120)
    turn = tokenizer("\n    def pop(self):")["input_ids"]
    second = stub.Generate(request("", 8, prompt_token_ids=turn, session_id=first.session_id, prompt_logprobs=True,
                                   top_logprobs=1), timeout=120)
    stub.EndSession(pb.EndSessionRequest(session_id=first.session_id))
    history = tokenizer("class Stack:\n")["input_ids"] + list(first.token_ids)
    check_prompt(target_model, history, turn, second.prompt_logprobs, top=1)
