"""--first-round target (the default): a call's first round is the target's prefill alone
(prompt lookup aside), so its first token streams as target-only decoding's does, while the
draft prefills the prompt and drafts the second round beside it; the answer is the target's
greedy answer all the same, the later rounds speculate, and a request fixing γ drafts its
first round as it asks. --first-round speculate drafts the first round as any other."""
from __future__ import annotations

import pytest
import torch

from tests.e2e.helpers import api, request
from tests.e2e.test_pipeline import target_greedy

pytestmark = pytest.mark.e2e
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def metrics_port():
    from localstack.stack import free_port

    return free_port()


@pytest.fixture(scope="module")
def first_round_target(local_stack, metrics_port):
    """An orchestrator of the shared stack's replicas with --first-round target, pre-drafting
    under load however few of its pre-drafts are used (--overlap-min-use 0) or are likely to
    be (--overlap-min-hit 0: at t = 1 on "def main(" the learnt guess rate sits near the
    default 0.25, and CI saw 87 used pre-drafts of the commonest first token in 3,600 calls)
    and speculating at any load (--load-governor off: on a slow spell the governor may find
    target-only faster under the callers below, and a target-only round pre-drafts
    nothing)."""
    orchestrator = local_stack.start_orchestrator(extra=["--first-round", "target", "--overlap-min-use", "0",
                                                         "--overlap-min-hit", "0", "--load-governor", "off",
                                                         "--metrics-port", str(metrics_port)])
    local_stack.wait_registered(1, 1)  # a round pre-drafts only with a draft replica to ask
    yield api(orchestrator.address)
    local_stack.orchestrators.remove(orchestrator)
    local_stack.kill(orchestrator, sig=15)


def chunks(stub, req) -> list:
    return list(stub.GenerateStream(req, timeout=120))


@pytest.fixture(scope="module")
def first_round_speculate(local_stack):
    orchestrator = local_stack.start_orchestrator(extra=["--first-round", "speculate"])
    yield api(orchestrator.address)
    local_stack.orchestrators.remove(orchestrator)
    local_stack.kill(orchestrator, sig=15)


def test_the_first_token_comes_alone_and_the_answer_is_the_targets(local_stack, target_model, tokenizer,
                                                                   heldout_prompts):
    first_round_target = api(local_stack.orchestrator_address)  # the default
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


def greedy_until_pre_drafted(stub, metrics_port: int, prompts, pre_drafted: int, target_model,
                             tokenizer) -> tuple[float, float]:
    """Greedy calls, each checked against the target's own greedy answer, until `pre_drafted`
    first rounds pre-drafted the second and one such pre-draft was used, or the prompts run
    out: a session whose policy prices speculation out at that moment drafts nothing (CI
    saw 5 of 6 on a slow spell, and 2 of the first 6 calls of a fresh orchestrator after
    the whole suite). → the first rounds' pre-drafts and those used, by the metrics."""
    from localstack.stack import scrape_metrics

    before = scrape_metrics(metrics_port)

    def counted() -> tuple[float, float]:
        after = scrape_metrics(metrics_port)
        return tuple(after.get(f'specdec_overlap_total{{outcome="{o}"}}', 0)
                     - before.get(f'specdec_overlap_total{{outcome="{o}"}}', 0) for o in ("first", "first_hit"))

    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        got = stub.Generate(request(prompt, NEW_TOKENS, 0.0, prompt_lookup=False), timeout=120)
        assert list(got.token_ids) == target_greedy(target_model, ids, NEW_TOKENS, tokenizer.eos_token_id)
        first, hits = counted()
        if first >= pre_drafted and hits > 0:
            break
    return first, hits


def test_the_draft_drafts_the_second_round_beside_the_first(first_round_target, metrics_port, target_model,
                                                            tokenizer, heldout_prompts):
    """While the target prefills the prompt, the draft prefills it too, guesses the first
    token and drafts the second round on it (PreDrafter.start), used where the
    guess was the target's token; greedy output stays the target's either way."""
    first, hits = greedy_until_pre_drafted(first_round_target, metrics_port, heldout_prompts[4:20], 4,
                                           target_model, tokenizer)
    assert first >= 4, "the first rounds did not pre-draft the second"
    assert hits > 0, "no first round's pre-draft was used"


def test_a_long_prompts_first_round_pre_drafts_in_chunks(first_round_target, metrics_port, target_model,
                                                          tokenizer, heldout_prompts):
    """A prompt longer than --prefill-chunk (256): beside the target's chunked prefill the
    draft is fed the prompt in chunks too (PreDrafter._feed_chunks) and drafts the second
    round; the answer is the target's greedy answer."""
    prompts = ["\n".join(heldout_prompts[i : i + 10]) for i in range(10)]  # 276-438 tokens
    assert min(len(tokenizer(p)["input_ids"]) for p in prompts) > 256
    first, hits = greedy_until_pre_drafted(first_round_target, metrics_port, prompts, 2, target_model, tokenizer)
    assert first >= 2, "long prompts' first rounds did not pre-draft the second"
    assert hits > 0, "no long prompt's pre-draft was used"


def test_sampled_tokens_after_a_pre_drafted_first_round_follow_the_target(first_round_target, target_model,
                                                                          tokenizer):
    """Unseeded t = 1: the first token is the target's prefill's; the second comes from a
    round pre-drafted beside it, kept where the draft's guess (under the target's noise) was
    that first token. Keeping it only then must not bias what follows: the second token,
    given the commonest first one, is still a draw from the target's law, over all calls and
    over those whose second round was the pre-draft."""
    import concurrent.futures as cf

    from tests.specdec.test_spec_loop import _chisq

    prompt = "def main("
    ids = tokenizer(prompt)["input_ids"]

    def call(_):  # four asked: the second round drafts up to two (a round drafts at most what
        # is left but one), and no later round can be pre-drafted (nothing would be left to
        # draft), so a used pre-draft (overlap_hits) is the second round's. Three asked made
        # a draft of one token, which the policy prices out under load for whole batches
        # (`python -m benchmarks.short_calls_probe`); ignore_eos: an end of sequence is a draw
        # like any other token, and no answer ends before its second (one did)
        got = first_round_target.Generate(request(prompt, 4, 1.0, ignore_eos=True), timeout=120)
        return got.token_ids[0], got.token_ids[1], got.stats.overlap_hits > 0

    def top_pre_drafted(calls: list) -> int:  # pre-drafts used after the commonest first token
        firsts = [f for f, _, _ in calls]
        top = max(set(firsts), key=firsts.count)
        return sum(f == top and hit for f, _, hit in calls)

    # calls in batches until enough second rounds after the commonest first token were
    # pre-drafted: stopping on first tokens and pre-draft use alone, both settled before the
    # second token is drawn, does not bias the tokens tested
    calls: list = []
    with cf.ThreadPoolExecutor(4) as pool:
        while len(calls) < 9600 and (not calls or top_pre_drafted(calls) < 150):
            calls += list(pool.map(call, range(600)))
    with torch.no_grad():
        p1 = torch.softmax(target_model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
    firsts = [f for f, _, _ in calls]
    assert _chisq(torch.bincount(torch.tensor(firsts), minlength=p1.shape[0]).double(), p1) > 1e-3
    top = max(set(firsts), key=firsts.count)
    with torch.no_grad():
        p2 = torch.softmax(target_model(input_ids=torch.tensor([ids + [top]])).logits[0, -1].float(), -1)
    seconds = [s for f, s, _ in calls if f == top]
    pre_drafted = [s for f, s, hit in calls if f == top and hit]
    assert len(pre_drafted) > 100, f"too few pre-drafts were used: {len(pre_drafted)} of {len(calls)} calls"
    for sample in (seconds, pre_drafted):
        assert _chisq(torch.bincount(torch.tensor(sample), minlength=p2.shape[0]).double(), p2) > 1e-3


def test_a_request_fixing_gamma_drafts_its_first_round(first_round_speculate, local_stack):
    fixed = chunks(api(local_stack.orchestrator_address), request("def main(", NEW_TOKENS, 0.0, gamma=4,
                                                                   prompt_lookup=False))
    speculating = chunks(first_round_speculate, request("def main(", NEW_TOKENS, 0.0, gamma=4, prompt_lookup=False))
    assert [list(c.token_ids) for c in fixed] == [list(c.token_ids) for c in speculating]  # the same rounds
    assert len(fixed[0].token_ids) > 1


def test_first_round_speculate_drafts_the_first_round(first_round_speculate, target_model, tokenizer,
                                                      heldout_prompts):
    firsts = []
    for prompt in heldout_prompts[:4]:
        ids = tokenizer(prompt)["input_ids"]
        got = chunks(first_round_speculate, request(prompt, NEW_TOKENS, 0.0, prompt_lookup=False))
        assert [t for c in got for t in c.token_ids] == target_greedy(target_model, ids, NEW_TOKENS,
                                                                      tokenizer.eos_token_id)
        firsts.append(len(got[0].token_ids))
    assert max(firsts) > 1, "no first round drafted"


def test_a_bad_first_round_setting_is_a_usage_error(local_stack):
    import subprocess
    import sys

    from localstack.stack import REPO_ROOT

    proc = subprocess.run([sys.executable, "-m", "orchestrator", "--port", "0"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60, env={**local_stack._env(), "SPECDEC_FIRST_ROUND": "draft"})
    assert proc.returncode == 2 and "SPECDEC_FIRST_ROUND='draft' is not a choice of --first-round" in proc.stderr
