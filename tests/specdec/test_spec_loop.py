"""The in-process speculative loop on the bundled pair: greedy identity with the target
alone, and the output law of sampling (chi-square), acceptance and tokens per pass."""
import pytest
import torch

from draft_service.engine import DraftEngine, ProposeJob
from specdec import rounds
from specdec.model_runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sessions import CacheRef
from tests.stats import chisquare_pvalue
from specdec.spec_loop import generate
from specdec.wire import decode, encode
from target_service.engine import TargetEngine, VerifyJob


@pytest.fixture(scope="module")
def engines(draft_model, target_model):
    return DraftEngine(ModelRunner(draft_model), 1024), TargetEngine(ModelRunner(target_model), 1024)


@pytest.fixture(scope="module")
def greedy_references(target_model, tokenizer, heldout_prompts):
    """Target-only greedy decoding by Hugging Face generate(), 64 tokens per held-out prompt."""
    refs = []
    for prompt in heldout_prompts:
        ids = tokenizer(prompt)["input_ids"]
        out = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64,
                                    pad_token_id=tokenizer.eos_token_id)
        refs.append((ids, out[0, len(ids):].tolist()))
    return refs


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_greedy_is_token_identical_to_target_generate(engines, tokenizer, greedy_references, gamma):
    draft, target = engines
    assert len(greedy_references) == 20
    for i, (ids, expected) in enumerate(greedy_references):
        got = generate(draft, target, ids, SamplingParams(temperature=0.0), gamma, 64,
                       eos_id=tokenizer.eos_token_id, session_id=f"p{i}")
        assert got.tokens == expected, f"prompt {i} differs at γ={gamma}"
        assert got.stats.target_passes < len(expected) or gamma == 1


def test_greedy_over_paged_caches_is_token_identical_to_target_generate(draft_model, target_model, tokenizer,
                                                                     greedy_references):
    """Both engines on paged caches and batched attention (a GPU's default), with prefix
    reuse sharing blocks between sessions of one prompt asked twice."""
    draft = DraftEngine(ModelRunner(draft_model, attention="paged"), 1024)
    target = TargetEngine(ModelRunner(target_model, attention="paged"), 1024)
    long = [t for ids, _ in greedy_references[:4] for t in ids]  # over MIN_SHARED tokens: reused
    out = target_model.generate(torch.tensor([long]), do_sample=False, max_new_tokens=64,
                                pad_token_id=tokenizer.eos_token_id)
    for i, (ids, expected) in enumerate(greedy_references[:8] + [(long, out[0, len(long):].tolist())] * 2):
        got = generate(draft, target, ids, SamplingParams(temperature=0.0), 4, 64,
                       eos_id=tokenizer.eos_token_id, session_id=f"p{i}")
        assert got.tokens == expected, f"prompt {i} differs"
    assert target.sessions.prefix_reuses >= 1 and draft.sessions.prefix_reuses >= 1
    held = [s.cache for s in target.sessions._sessions.values()] + [c for _, c, _ in target.sessions._retired.values()]
    assert sum(c.nbytes for c in held) == target.runner.pool.used * target.runner.pool.block_bytes


def _first_round(draft, target, ids, params_list, gamma):
    """One speculation round for many seeded sessions at once (batched by 500)."""
    if len(params_list) > 500:
        a = _first_round(draft, target, ids, params_list[:500], gamma)
        b = _first_round(draft, target, ids, params_list[500:], gamma)
        return a[0] + b[0], a[1] + b[1]
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
    obs_k, exp_k = obs_b[keep], exp_b[keep]
    return chisquare_pvalue(obs_k, exp_k / exp_k.sum() * obs_k.sum())


def test_first_and_second_tokens_follow_the_target(engines, target_model, tokenizer):
    draft, target = engines
    ids = tokenizer("    def __init__(self, ")["input_ids"]
    gamma, trials = 4, 3000
    params = [SamplingParams(temperature=1.0, seed=10_000 + i) for i in range(trials)]
    firsts, seconds = [], []
    props, verdicts = _first_round(draft, target, ids, params, gamma)
    for pr, v in zip(props, verdicts):
        toks = rounds.new_tokens(pr.tokens, v.accepted, v.next_token)
        firsts.append(toks[0])
        seconds.append(toks[1] if len(toks) > 1 else None)
    with torch.no_grad():
        p1 = torch.softmax(target_model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
    V = p1.shape[0]
    assert _chisq(torch.bincount(torch.tensor(firsts), minlength=V).double(), p1) > 1e-3
    # second token, given the most common first token: from the same round when it went on,
    # else from the next round (a fresh cache over the same committed prefix, same seed)
    top = max(set(firsts), key=firsts.count)
    picked = [i for i, f in enumerate(firsts) if f == top]
    redo = [i for i in picked if seconds[i] is None]
    props, verdicts = _first_round(draft, target, ids + [top], [params[i] for i in redo], gamma)
    for i, pr, v in zip(redo, props, verdicts):
        seconds[i] = rounds.new_tokens(pr.tokens, v.accepted, v.next_token)[0]
    cond = [seconds[i] for i in picked]
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
