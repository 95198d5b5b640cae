"""--first-round target: a call's first round is the target's prefill alone (prompt lookup
aside), so its first token streams as target-only decoding's does; the answer is the
target's greedy answer all the same, the later rounds speculate, and a request fixing γ
drafts its first round as it asks."""
from __future__ import annotations

import pytest

from tests.e2e.helpers import api, request
from tests.e2e.test_pipeline import target_greedy

pytestmark = pytest.mark.e2e
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def first_round_target(local_stack):
    """An orchestrator of the shared stack's replicas with --first-round target."""
    orchestrator = local_stack.start_orchestrator(extra=["--first-round", "target"])
    yield api(orchestrator.address)
    local_stack.orchestrators.remove(orchestrator)
    local_stack.kill(orchestrator, sig=15)


def chunks(stub, req) -> list:
    return list(stub.GenerateStream(req, timeout=120))


def test_the_first_token_comes_alone_and_the_answer_is_the_targets(first_round_target, target_model, tokenizer,
                                                                   heldout_prompts):
    for prompt in heldout_prompts[:4]:
        ids = tokenizer(prompt)["input_ids"]
        got = chunks(first_round_target, request(prompt, NEW_TOKENS, 0.0, prompt_lookup=False))
        tokens = [t for c in got for t in c.token_ids]
        assert tokens == target_greedy(target_model, ids, NEW_TOKENS, tokenizer.eos_token_id)
        assert len(got[0].token_ids) == 1, "the first round drafted"
        stats = got[-1].stats
        assert stats.drafted_tokens > 0 and stats.rounds >= 2  # the rounds after it speculated
        # sampled too: the first round is the target's alone, the law is the target's either way
        sampled = chunks(first_round_target, request(prompt, 8, 1.0, seed=7))
        assert len(sampled[0].token_ids) == 1


def test_a_request_fixing_gamma_drafts_its_first_round(first_round_target, local_stack):
    fixed = chunks(first_round_target, request("def main(", NEW_TOKENS, 0.0, gamma=4, prompt_lookup=False))
    default = chunks(api(local_stack.orchestrator_address), request("def main(", NEW_TOKENS, 0.0, gamma=4,
                                                                     prompt_lookup=False))
    assert [list(c.token_ids) for c in fixed] == [list(c.token_ids) for c in default]  # the same rounds


def test_a_bad_first_round_setting_is_a_usage_error(local_stack):
    import subprocess
    import sys

    from localstack.stack import REPO_ROOT

    proc = subprocess.run([sys.executable, "-m", "orchestrator", "--port", "0"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60, env={**local_stack._env(), "SPECDEC_FIRST_ROUND": "draft"})
    assert proc.returncode == 2 and "SPECDEC_FIRST_ROUND='draft' is not a choice of --first-round" in proc.stderr
