"""A long prompt reaches the replicas in chunks (`--prefill-chunk`): the tokens are those of
one call per prompt, greedy and seeded sampled alike, while each chunk is a forward of its
own at the target, so that a long prefill holds the other sessions of a batch only for a
chunk's share."""
from __future__ import annotations

import pytest

from tests.e2e.helpers import api, load_report, request

pytestmark = pytest.mark.e2e

CHUNK = 64
PROMPT = "x = compute(a, b)  # step\n" * 22  # 308 tokens


@pytest.fixture(scope="module")
def stubs(local_stack):
    """→ (an orchestrator feeding prompts in chunks of CHUNK tokens, one feeding them whole)."""
    started = [local_stack.start_orchestrator(extra=["--prefill-chunk", str(chunk)]) for chunk in (CHUNK, 0)]
    yield tuple(api(o.address) for o in started)
    for rep in started:
        local_stack.kill(rep, sig=15)
        local_stack.orchestrators.remove(rep)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prompt_fed_in_chunks_gives_the_tokens_of_one_fed_whole(stubs, tokenizer, temperature):
    chunked, whole = stubs
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    assert prompt_len > 4 * CHUNK
    req = request(PROMPT, 24, temperature, gamma=4, seed=77)  # a fixed γ: the same rounds every time
    want = whole.Generate(req, timeout=120)
    target = want.stats.target_replica
    passes = [load_report(target, "target").forward_passes]
    again = whole.Generate(req, timeout=120)
    passes.append(load_report(target, "target").forward_passes)
    got = chunked.Generate(req, timeout=120)
    passes.append(load_report(target, "target").forward_passes)
    assert list(again.token_ids) == list(want.token_ids)
    assert list(got.token_ids) == list(want.token_ids)
    assert got.stats.rounds == want.stats.rounds and got.stats.accepted_tokens == want.stats.accepted_tokens
    if got.stats.target_replica == again.stats.target_replica == target:  # a second target may be up (test_metrics)
        # every chunk but the last was a forward of its own, before the rounds' forwards
        extra = (passes[2] - passes[1]) - (passes[1] - passes[0])
        assert extra == (prompt_len - 1) // CHUNK
