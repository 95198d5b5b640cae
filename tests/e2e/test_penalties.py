"""Penalties through the whole stack: greedy answers are token for token those of the
target alone under the same penalty (transformers' generate() for repetition, a plain loop
for presence and frequency), speculating or not, on a new session and a kept one's next turn."""
from __future__ import annotations

import grpc
import pytest
import torch

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import api, request, stream
from tests.specdec.test_penalties import reference
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.e2e
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add("  # the bundled target repeats itself here


def greedy_loop(model, context: list[int], n: int, start: int, params: SamplingParams) -> list[int]:
    """The target alone, one full forward a token, each row penalised by its own prefix."""
    out = list(context)
    with torch.no_grad():
        for _ in range(n):
            row = model(input_ids=torch.tensor([out])).logits[0, -1].float()
            out.append(int(reference(row, out, start, params).argmax()))
    return out[len(context):]


def test_repetition_penalty_is_transformers_greedy_under_it(local_stack, target_model, tokenizer):
    stub = api(local_stack.orchestrator_address)
    ids = tokenizer(PROMPT)["input_ids"]
    plain = list(stub.Generate(request(PROMPT, 40, 0.0), timeout=120).token_ids)
    theirs = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40, repetition_penalty=1.3,
                                   pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert theirs != plain  # the penalty changes this answer: the comparison below can fail
    for gamma in (None, 4, 0):
        got = stub.Generate(request(PROMPT, 40, 0.0, gamma=gamma, repetition_penalty=1.3), timeout=120)
        assert list(got.token_ids) == theirs, gamma
    tokens, _, _ = stream(stub, request(PROMPT, 40, 0.0, repetition_penalty=1.3))
    assert tokens == theirs


@pytest.mark.parametrize("fields", [dict(presence_penalty=1.5), dict(frequency_penalty=0.8),
                                    dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)])
def test_presence_and_frequency_count_the_answer_only_and_a_kept_session_s_history_counts_for_repetition(
        local_stack, target_model, tokenizer, fields):
    stub = api(local_stack.orchestrator_address)
    params = SamplingParams(0.0, **fields)
    first = stub.Generate(request(PROMPT, 12, 0.0, keep_session=True), timeout=120)
    try:
        turn = "\n\ndef add("
        second = stub.Generate(request(turn, 32, 0.0, gamma=4, session_id=first.session_id, **fields), timeout=120)
    finally:
        stub.EndSession(pb.EndSessionRequest(session_id=first.session_id))
    history = tokenizer(PROMPT)["input_ids"] + list(first.token_ids) + tokenizer(turn)["input_ids"]
    expected = greedy_loop(target_model, history, 32, len(history), params)
    assert list(second.token_ids) == expected
    unpenalised = greedy_loop(target_model, history, 32, len(history), SamplingParams(0.0))
    assert expected != unpenalised  # the penalty bites here


def test_sampled_penalised_answers_are_seeded_and_keep_to_the_target_s_support(local_stack, target_model,
                                                                              tokenizer):
    """A penalised law with top-k: every drawn token lies among the k likeliest of the
    penalised row (under a plain forward), and the same seed gives the same answer."""
    stub = api(local_stack.orchestrator_address)
    ids = tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(1.0, top_k=3, repetition_penalty=1.5, presence_penalty=1.0)
    for seed in (1, 2):
        req = request(PROMPT, 30, 1.0, top_k=3, seed=seed, repetition_penalty=1.5, presence_penalty=1.0)
        a, b = stub.Generate(req, timeout=120), stub.Generate(req, timeout=120)
        assert list(a.token_ids) == list(b.token_ids)
        text = ids + list(a.token_ids)
        with torch.no_grad():
            logits = target_model(input_ids=torch.tensor([text])).logits[0].float()
        for i, token in enumerate(a.token_ids):
            at = len(ids) + i
            row = reference(logits[at - 1], text[:at], len(ids), params)
            assert token in row.topk(3).indices.tolist(), (seed, i)


@pytest.mark.parametrize("fields, says", [
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=11.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
])
def test_bad_penalties_are_refused_clearly(local_stack, fields, says):
    stub = api(local_stack.orchestrator_address)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request("x", 4, **fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()


@pytest.mark.parametrize("fields", [dict(temperature=0.0), dict(temperature=1.0, seed=21, top_k=8)])
def test_a_cut_penalised_answer_retried_with_its_id_is_the_uninterrupted_one(local_stack, fields):
    """The retry counts the answer from where the first attempt's began (penalty_start),
    not from where the retry takes over."""
    from tests.e2e.test_request_ids import cut_after_first_chunk, retried, rid

    stub = api(local_stack.orchestrator_address)
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4)
    whole = stub.Generate(request(PROMPT, 160, **fields, **penalties), timeout=120)
    req = request(PROMPT, 160, **fields, **penalties, request_id=rid())
    received = cut_after_first_chunk(stub, req)
    again = retried(stub, req)
    assert 0 < again.stats.resumed_tokens < len(again.token_ids)
    assert list(again.token_ids) == list(whole.token_ids) and list(again.token_ids[:len(received)]) == received
