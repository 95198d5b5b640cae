"""The in-process speculative loop on the bundled pair: greedy identity with the target
alone, and the output law of sampling (chi-square), acceptance and tokens per pass."""
import pytest
import torch
from scipy.stats import chisquare

from draft_service.engine import DraftEngine, ProposeJob
from specdec import rounds, sampling
from specdec.model_runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sessions import CacheRef
from specdec.spec_loop import generate
from specdec.wire import decode, encode
from target_service.engine import TargetEngine, VerifyJob


@pytest.fixture(scope="module")
def engines(draft_model, target_model):
    return DraftEngine(ModelRunner(draft_model)), TargetEngine(ModelRunner(target_model))


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_greedy_is_token_identical_to_target_generate(engines, target_model, tokenizer, heldout_prompts, gamma):
    draft, target = engines
    for i, prompt in enumerate(heldout_prompts):
        ids = tokenizer(prompt)["input_ids"]
        expected = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64,
                                         pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        got = generate(draft, target, ids, SamplingParams(temperature=0.0), gamma, 64,
                       eos_id=tokenizer.eos_token_id, session_id=f"p{i}")
        assert got.tokens == expected, f"prompt {i} differs at γ={gamma}"
        assert got.stats.target_passes < len(expected) or gamma == 1


def _first_round(draft, target, ids, params_list, gamma):
    """One speculation round for many seeded sessions at once (batched)."""
    jobs = [ProposeJob(CacheRef(f"s{i}", 1, 0, ids), gamma, p) for i, p in enumerate(params_list)]
    props = draft.propose(jobs)
    vjobs = [VerifyJob(CacheRef(f"s{i}", 1, 0, ids), pr.tokens, decode(encode(pr.q), gamma), p)
             for i, (pr, p) in enumerate(zip(props, params_list))]
    verdicts = target.verify(vjobs)
    for i in range(len(params_list)):
        draft.release(f"s{i}")
        target.release(f"s{i}")
    return props, verdicts


def _chisq(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Chi-square p-value with the rare tokens pooled into one bin (expected count ≥ 5)."""
    n = observed.sum()
    exp = expected_p.double() / expected_p.sum() * n
    big = exp >= 5
    obs_b = torch.cat([observed[big], observed[~big].sum()[None]])
    exp_b = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_b > 0
    return chisquare(obs_b[keep].numpy(), exp_b[keep].numpy()).pvalue


def test_first_and_second_tokens_follow_the_target(engines, target_model, tokenizer):
    draft, target = engines
    ids = tokenizer("    def __init__(self, ")["input_ids"]
    gamma, trials = 4, 3000
    params = [SamplingParams(temperature=1.0, seed=10_000 + i) for i in range(trials)]
    firsts, seconds = [], []
    for chunk in range(0, trials, 500):
        props, verdicts = _first_round(draft, target, ids, params[chunk:chunk + 500], gamma)
        for pr, v in zip(props, verdicts):
            toks = rounds.new_tokens(pr.tokens, v.accepted, v.next_token)
            firsts.append(toks[0])
            seconds.append(toks[1] if len(toks) > 1 else None)
    with torch.no_grad():
        p1 = torch.softmax(target_model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
    V = p1.shape[0]
    assert _chisq(torch.bincount(torch.tensor(firsts), minlength=V).double(), p1) > 1e-3
    # second token, given the most common first token (the round's own tokens only)
    top = max(set(firsts), key=firsts.count)
    cond = [s for f, s in zip(firsts, seconds) if f == top and s is not None]
    with torch.no_grad():
        p2 = torch.softmax(target_model(input_ids=torch.tensor([ids + [top]])).logits[0, -1].float(), -1)
    assert len(cond) > 300
    assert _chisq(torch.bincount(torch.tensor(cond), minlength=V).double(), p2) > 1e-3


def test_acceptance_matches_sum_of_min_p_q(engines, target_model, draft_model, tokenizer):
    draft, target = engines
    ids = tokenizer("import os\nimport sys\n\n\ndef main(")["input_ids"]
    trials = 2000
    props, verdicts = _first_round(draft, target, ids,
                                   [SamplingParams(temperature=1.0, seed=i) for i in range(trials)], 1)
    with torch.no_grad():
        p = torch.softmax(target_model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
        q = torch.softmax(draft_model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
    alpha = float(torch.minimum(p, q.half().double() / q.half().double().sum()).sum())
    measured = sum(v.accepted for v in verdicts) / trials
    assert abs(measured - alpha) < 4 * (alpha * (1 - alpha) / trials) ** 0.5 + 0.005


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_per_pass_match_the_formula(engines, tokenizer, heldout_prompts, temperature):
    draft, target = engines
    gamma, produced, passes, accepted, trials = 4, 0, 0, 0, 0
    for i, prompt in enumerate(heldout_prompts):
        ids = tokenizer(prompt)["input_ids"]
        res = generate(draft, target, ids, SamplingParams(temperature=temperature, seed=i), gamma, 96,
                       session_id=f"f{i}")
        produced += len(res.tokens)
        passes += res.stats.target_passes
        for n, in zip(res.stats.accepted_per_round):
            accepted += n
            trials += min(n + 1, gamma)  # tokens tried until the first rejection
    alpha = accepted / trials
    expected = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    measured = produced / passes
    assert abs(measured - expected) / expected < 0.10, (measured, expected, alpha)
