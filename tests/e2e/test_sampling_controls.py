"""min_p, stop_token_ids and ignore_eos through the whole stack, checked against plain
forwards of the bundled target (the laws' exactness is tests/specdec/test_sampling.py's)."""
from __future__ import annotations

import pytest
import torch

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import api, request, stream

pytestmark = pytest.mark.e2e
ENDS_AT_ONCE = 'if __name__ == "__main__":\n    unittest.main()\n'  # the target's greedy answer: EOS first


def smallest_ratios(model, prompt_ids: list[int], tokens: list[int], temperature: float) -> float:
    """The smallest p(token) / max p over the answer's positions, under the target at `temperature`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + tokens])).logits[0].float()
    probs = torch.softmax(logits[len(prompt_ids) - 1:-1] / temperature, -1)
    picked = probs[torch.arange(len(tokens)), torch.tensor(tokens)]
    return float((picked / probs.amax(-1)).min())


@pytest.mark.parametrize("gamma", [None, 4, 0])
def test_a_min_p_answer_draws_only_tokens_the_target_keeps_under_it(local_stack, target_model, tokenizer, gamma):
    stub = api(local_stack.orchestrator_address)
    prompt = "def parse(line):\n    "
    ids = tokenizer(prompt)["input_ids"]
    cut, loose = [], []
    for seed in (1, 2, 3):
        asked = stub.Generate(request(prompt, 40, 1.0, gamma=gamma, seed=seed, min_p=0.3, ignore_eos=True),
                              timeout=120)
        again = stub.Generate(request(prompt, 40, 1.0, gamma=gamma, seed=seed, min_p=0.3, ignore_eos=True),
                              timeout=120)
        plain = stub.Generate(request(prompt, 40, 1.0, gamma=gamma, seed=seed, ignore_eos=True), timeout=120)
        assert list(asked.token_ids) == list(again.token_ids)  # seeded: reproducible under min_p too
        cut.append(smallest_ratios(target_model, ids, list(asked.token_ids), 1.0))
        loose.append(smallest_ratios(target_model, ids, list(plain.token_ids), 1.0))
    assert min(cut) >= 0.3 * 0.99, cut  # float32 rows of another kernel may differ at the edge
    assert min(loose) < 0.3, loose  # without min_p such tokens come out: the check above can fail


def test_a_stop_token_ends_the_answer_after_it(local_stack, tokenizer):
    stub = api(local_stack.orchestrator_address)
    prompt = "class Stack:\n    def push(self, item):\n"
    full = list(stub.Generate(request(prompt, 40, 0.0), timeout=120).token_ids)
    k = next(i for i in range(8, len(full)) if full[i] not in full[:i])  # a token's first time, a way in
    absent = next(t for t in range(100, 200) if t not in full)
    for gamma in (None, 4, 0):
        unary = stub.Generate(request(prompt, 40, 0.0, gamma=gamma, stop_token_ids=[absent, full[k]]), timeout=120)
        assert list(unary.token_ids) == full[: k + 1]
        assert unary.finish_reason == pb.FINISH_REASON_STOP
        assert unary.text == tokenizer.decode(full[: k + 1])
        tokens, text, last = stream(stub, request(prompt, 40, 0.0, gamma=gamma, stop_token_ids=[full[k]]))
        assert tokens == full[: k + 1] and text == unary.text
        assert last.finish_reason == pb.FINISH_REASON_STOP


def greedy_past_eos(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_ignore_eos_goes_on_past_it_to_max_new_tokens(local_stack, target_model, tokenizer):
    stub = api(local_stack.orchestrator_address)
    ends = stub.Generate(request(ENDS_AT_ONCE, 16, 0.0), timeout=120)
    assert list(ends.token_ids) == [tokenizer.eos_token_id] and ends.finish_reason == pb.FINISH_REASON_EOS
    expected = greedy_past_eos(target_model, tokenizer(ENDS_AT_ONCE)["input_ids"], 16)
    assert expected[0] == tokenizer.eos_token_id
    for gamma in (None, 4):
        on = stub.Generate(request(ENDS_AT_ONCE, 16, 0.0, gamma=gamma, ignore_eos=True), timeout=120)
        assert list(on.token_ids) == expected and on.finish_reason == pb.FINISH_REASON_LENGTH
        tokens, _, last = stream(stub, request(ENDS_AT_ONCE, 16, 0.0, gamma=gamma, ignore_eos=True))
        assert tokens == expected and last.finish_reason == pb.FINISH_REASON_LENGTH
    # with EOS ignored, it still ends the answer where the request names it a stop token
    named = stub.Generate(request(ENDS_AT_ONCE, 16, 0.0, ignore_eos=True, stop_token_ids=[tokenizer.eos_token_id]),
                          timeout=120)
    assert list(named.token_ids) == [tokenizer.eos_token_id] and named.finish_reason == pb.FINISH_REASON_STOP


def biased_greedy(model, ids: list[int], n: int, bias: dict[int, float], banned: set[int], until: int,
                  eos: int | None) -> list[int]:
    """The target alone, one full forward a token: bias added, `banned` out before position
    `until`, the argmax, up to EOS."""
    out = list(ids)
    with torch.no_grad():
        while len(out) < len(ids) + n:
            row = model(input_ids=torch.tensor([out])).logits[0, -1].float()
            for token, b in bias.items():
                row[token] += b
            if len(out) < until:
                row[list(banned)] = float("-inf")
            out.append(int(row.argmax()))
            if out[-1] == eos:
                break
    return out[len(ids):]


def test_a_logit_bias_steers_the_answer_as_it_steers_the_target_alone(local_stack, target_model, tokenizer):
    stub = api(local_stack.orchestrator_address)
    prompt = "class Stack:\n    def push(self, item):\n"
    ids = tokenizer(prompt)["input_ids"]
    full = list(stub.Generate(request(prompt, 32, 0.0), timeout=120).token_ids)
    bias = {full[3]: -100.0, full[10]: -100.0, 13: 4.0}  # two of its tokens all but banned, one favoured
    expected = biased_greedy(target_model, ids, 32, bias, set(), 0, tokenizer.eos_token_id)
    assert expected != full and full[3] not in expected
    for gamma in (None, 4, 0):
        got = stub.Generate(request(prompt, 32, 0.0, gamma=gamma, logit_bias=bias), timeout=120)
        assert list(got.token_ids) == expected, gamma
    sampled = stub.Generate(request(prompt, 32, 1.0, seed=3, logit_bias={full[0]: -100.0}), timeout=120)
    assert full[0] not in sampled.token_ids


def test_min_tokens_keeps_the_answer_from_ending_before_it(local_stack, target_model, tokenizer):
    stub = api(local_stack.orchestrator_address)
    ids = tokenizer(ENDS_AT_ONCE)["input_ids"]
    eos = tokenizer.eos_token_id
    for gamma in (None, 4, 0):
        got = stub.Generate(request(ENDS_AT_ONCE, 40, 0.0, gamma=gamma, min_tokens=6), timeout=120)
        expected = biased_greedy(target_model, ids, 40, {}, {eos}, len(ids) + 6, eos)
        assert list(got.token_ids) == expected, gamma
        assert len(got.token_ids) >= 6 and eos not in got.token_ids[:6]
    # a stop token is held off as EOS is
    first = biased_greedy(target_model, ids, 8, {}, {eos}, len(ids) + 8, eos)
    held = stub.Generate(request(ENDS_AT_ONCE, 12, 0.0, min_tokens=3, stop_token_ids=[first[1]]), timeout=120)
    assert first[1] not in held.token_ids[:3] and eos not in held.token_ids[:3]


def test_min_tokens_holds_stop_strings_off_too(local_stack, tokenizer):
    """A stop string the greedy answer completes within its first min_tokens tokens does not
    end it; one completed later does (the text cut before it, finish reason STOP)."""
    stub = api(local_stack.orchestrator_address)
    prompt = "class Stack:\n    def push(self, item):\n"
    full = list(stub.Generate(request(prompt, 60, 0.0, ignore_eos=True), timeout=120).token_ids)
    text = tokenizer.decode(full)
    stop = next(c for c in ("self", "(", ".", "\n") if text.count(c) >= 2)  # twice in the answer
    completes = next(n for n in range(1, len(full) + 1) if stop in tokenizer.decode(full[:n]))
    early = stub.Generate(request(prompt, 60, 0.0, ignore_eos=True, stop=[stop]), timeout=120)
    assert early.text == text[: text.index(stop)] and early.finish_reason == pb.FINISH_REASON_STOP
    floor = len(tokenizer.decode(full[:completes]))  # the text of the tokens min_tokens holds off
    later = text.find(stop, floor - len(stop) + 1)  # the first occurrence a later token completes
    assert later > text.index(stop)
    for gamma in (None, 4, 0):
        held = stub.Generate(request(prompt, 60, 0.0, gamma=gamma, ignore_eos=True, stop=[stop],
                                     min_tokens=completes + 1), timeout=120)
        assert held.text == text[:later], gamma
        assert held.finish_reason == pb.FINISH_REASON_STOP and len(held.token_ids) > completes
        tokens, streamed, last = stream(stub, request(prompt, 60, 0.0, gamma=gamma, ignore_eos=True, stop=[stop],
                                                     min_tokens=completes + 1))
        assert streamed == held.text and last.finish_reason == pb.FINISH_REASON_STOP
