"""DraftEngine on the bundled draft: greedy proposals take the argmax and carry no
distributions (the greedy rule needs none), sampled ones carry exactly what they were
drawn from, and a session drafts the same tokens alone or in a mixed batch."""
import pytest
import torch

from draft_service.engine import DraftEngine, ProposeJob
from specdec.model_runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sessions import CacheRef

GAMMA = 5


def test_greedy_proposals_are_the_argmax_and_carry_no_distributions(draft_model, tokenizer):
    engine = DraftEngine(ModelRunner(draft_model))
    ids = tokenizer("def walk(root):\n    for name in ")["input_ids"]
    greedy, sampled = SamplingParams(0.0), SamplingParams(1.0, seed=9)

    alone = engine.propose([ProposeJob(CacheRef("alone", 1, 0, ids), GAMMA, greedy)])[0]
    mixed = engine.propose([ProposeJob(CacheRef("g", 1, 0, ids), GAMMA, greedy),
                            ProposeJob(CacheRef("s", 1, 0, ids), GAMMA, sampled)])

    expected = draft_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=GAMMA,
                                    pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert alone.tokens == expected and alone.q is None
    assert mixed[0].tokens == expected and mixed[0].q is None
    q = mixed[1].q
    assert q is not None and tuple(q.shape) == (GAMMA, engine.runner.vocab_size)
    assert torch.equal(q, q.half().float())  # fp16-exact: what travels is what was sampled from
    assert all(q[i, t] > 0 for i, t in enumerate(mixed[1].tokens))


def test_a_pre_draft_guesses_the_bonus_under_the_targets_noise(draft_model, tokenizer):
    """guess_bonus: the first token is drawn from its q with the bonus stream's noise
    at its position (what the target's bonus is drawn with), and the tokens after it are
    exactly what a plain proposal drafts on the prefix that ends in the guess."""
    from specdec import sampling

    engine = DraftEngine(ModelRunner(draft_model))
    ids = tokenizer("def walk(root):\n    for name in ")["input_ids"]
    params = SamplingParams(1.0, seed=21)
    pre = engine.propose([ProposeJob(CacheRef("pre", 1, 0, ids), GAMMA, params, guess_bonus=True)])[0]
    noise = sampling.bonus_noise([21], [len(ids)], engine.runner.vocab_size)
    assert pre.tokens[0] == int(sampling.race_argmax(pre.q[:1], noise)[0])
    # the same prefix the same way: the prompt's prefill, then the guess as one step
    engine.propose([ProposeJob(CacheRef("plain", 1, 0, ids), 1, params)])
    plain = engine.propose([ProposeJob(CacheRef("plain", 1, len(ids), pre.tokens[:1]), GAMMA - 1, params)])[0]
    assert plain.tokens == pre.tokens[1:]
    assert torch.equal(plain.q, pre.q[1:])
    # a greedy guess is the argmax, as any greedy draft token
    greedy = engine.propose([ProposeJob(CacheRef("g", 1, 0, ids), 2, SamplingParams(0.0), guess_bonus=True)])[0]
    assert greedy.tokens == engine.propose([ProposeJob(CacheRef("g2", 1, 0, ids), 2, SamplingParams(0.0))])[0].tokens


def test_a_proposal_stops_after_the_first_token_the_draft_is_unsure_of(draft_model, tokenizer):
    """stop_below: the proposal is the full one's prefix up to and including the first
    token drafted at a step whose top probability (temperature 1) is below the threshold;
    the session's cache holds the prefix fed so far, as after any proposal."""
    from specdec import sampling

    engine = DraftEngine(ModelRunner(draft_model))
    ids = tokenizer("import os\n\ndef main(argv):\n    ")["input_ids"]
    for params in (SamplingParams(0.0), SamplingParams(1.0, seed=5)):
        full = engine.propose([ProposeJob(CacheRef("full", 1, 0, ids), GAMMA, params)])[0]
        # the top probability of each step of the full proposal, from the draft's own forward
        logits = draft_model(torch.tensor([ids + full.tokens[:-1]])).logits[0, len(ids) - 1:]
        top = sampling.top_probability(logits).tolist()
        threshold = sorted(top)[GAMMA // 2] + 1e-6  # some steps above it, some below
        keep = next(i + 1 for i, t in enumerate(top) if t < threshold)
        cut = engine.propose([ProposeJob(CacheRef("cut", 1, 0, ids), GAMMA, params, stop_below=threshold)])[0]
        assert 1 <= keep < GAMMA and cut.tokens == full.tokens[:keep]
        assert cut.cache_length == len(ids) + keep - 1  # the last drafted token is still pending
        if params.greedy:
            assert cut.q is None
        else:
            assert torch.equal(cut.q, full.q[:keep])
        engine.release("full"), engine.release("cut")
    # never cut after a pre-draft's bonus guess; 0 = draft all γ
    sure = engine.propose([ProposeJob(CacheRef("g", 1, 0, ids), GAMMA, SamplingParams(0.0), guess_bonus=True,
                                      stop_below=0.999999)])[0]
    assert len(sure.tokens) == 2
    off = engine.propose([ProposeJob(CacheRef("o", 1, 0, ids), GAMMA, SamplingParams(0.0), stop_below=0.0)])[0]
    assert len(off.tokens) == GAMMA


def test_runner_ups_and_a_fork_leave_the_sessions_cache_alone(draft_model, tokenizer):
    """runner_ups: each step's largest other token. fork: a branch drafted from a runner-up
    in a private copy of the session's cache, in one batch with the session's own next
    proposal: the fork drafts what a fresh session drafts on that prefix, and the session's
    own proposal is what it would have been without the fork beside it."""
    engine = DraftEngine(ModelRunner(draft_model))
    ids = tokenizer("def walk(root):\n    for name in ")["input_ids"]
    greedy = SamplingParams(0.0)
    first = engine.propose([ProposeJob(CacheRef("s", 1, 0, ids), GAMMA, greedy, runner_ups=True)])[0]
    assert len(first.runner_ups) == GAMMA and all(a != b for a, b in zip(first.tokens, first.runner_ups))
    logits = draft_model(torch.tensor([ids + first.tokens])).logits[0, len(ids) - 1 : len(ids) - 1 + GAMMA]
    assert [int(row.topk(2).indices[1]) for row in logits] == first.runner_ups
    j = 2  # the branch: the first two draft tokens kept, the third corrected to its runner-up
    branch = ids + first.tokens[:j] + [first.runner_ups[j]]
    fork_job = ProposeJob(CacheRef("s", 1, len(ids) + j, [first.runner_ups[j]]), GAMMA, greedy,
                          runner_ups=True, fork=True)
    own_job = ProposeJob(CacheRef("s", 1, len(ids) + GAMMA - 1, first.tokens[-1:]), GAMMA, greedy)
    fork, own = engine.propose([fork_job, own_job])
    fresh = DraftEngine(ModelRunner(draft_model))
    assert fork.tokens == fresh.propose([ProposeJob(CacheRef("f", 1, 0, branch), GAMMA, greedy)])[0].tokens
    alone = fresh.propose([ProposeJob(CacheRef("o", 1, 0, ids + first.tokens), GAMMA, greedy)])[0]
    assert own.tokens == alone.tokens
    assert engine.sessions._sessions["s"].cache.length == len(ids) + 2 * GAMMA - 1
    # a fork needs the session's cache to hold its base
    bad = engine.propose([ProposeJob(CacheRef("s", 1, len(ids) + 50, [1]), 1, greedy, fork=True)])[0]
    assert type(bad).__name__ == "CacheMismatch"
    sampled = engine.propose([ProposeJob(CacheRef("t", 1, 0, ids), 2, SamplingParams(1.0), runner_ups=True)])[0]
    assert type(sampled).__name__ == "InvalidRequest"


def test_greedy_batches_drafted_in_one_native_call_are_the_step_by_step_loops(draft_model, tokenizer):
    """ModelRunner.draft_greedy (every step of a plain greedy proposal in one call) against the
    engine's own loop (a runner without the whole native forward): the same tokens, cache
    lengths and cached keys and values, over sessions of different γ and catch-up lengths."""
    import copy

    fast = DraftEngine(ModelRunner(copy.deepcopy(draft_model), linear_kernels="half"))
    slow = DraftEngine(ModelRunner(copy.deepcopy(draft_model), linear_kernels="half", whole_forward=False))
    assert fast.runner.whole and not slow.runner.whole
    prompts = [tokenizer(p)["input_ids"] for p in ("import os\n", "def walk(root):\n    for ", "class A:\n")]
    greedy = SamplingParams(0.0)
    starts = [0, 0, 0]
    for gammas in ((4, 1, 7), (2, 5, 3), (1, 1, 1)):
        feeds = [p if s == 0 else [7 + i] for i, (p, s) in enumerate(zip(prompts, starts))]
        jobs = [ProposeJob(CacheRef(f"s{i}", 1, s, f), g, greedy) for i, (s, f, g) in enumerate(zip(starts, feeds, gammas))]
        passes = (fast.forward_passes, slow.forward_passes)
        got, want = fast.propose(jobs), slow.propose(jobs)
        for a, b, g in zip(got, want, gammas):
            assert a.tokens == b.tokens and len(a.tokens) == g and a.q is None
            assert a.cache_length == b.cache_length and a.batch_size == b.batch_size == 3
        assert fast.forward_passes - passes[0] == slow.forward_passes - passes[1] == max(gammas)
        assert fast.fed_tokens == slow.fed_tokens
        for i in range(3):
            ca, cb = fast.sessions._sessions[f"s{i}"].cache, slow.sessions._sessions[f"s{i}"].cache
            assert ca.length == cb.length
            assert torch.allclose(ca.kv[:, :, : ca.length], cb.kv[:, :, : cb.length], atol=1e-5)
        # the next call commits the first token of each draft (a round that kept nothing)
        starts = [s + len(f) for s, f in zip(starts, feeds)]


LAWS = {"t1": {}, "t0.7": {"temperature": 0.7}, "top_k": {"top_k": 40}, "top_p": {"top_p": 0.9},
        "min_p": {"min_p": 0.05}, "all": {"temperature": 0.8, "top_k": 200, "top_p": 0.95, "min_p": 0.02}}


@pytest.mark.parametrize("law", LAWS)
def test_sampled_batches_drafted_in_one_native_call_are_the_step_by_step_loops(draft_model, tokenizer, law):
    """ModelRunner.draft_sampled (every step of a sampled proposal in one call) against the
    engine's own loop: the same tokens and the same fp16 distributions to the bit (what the
    target is sent and the tokens were drawn from), the same cache lengths and caches, under
    plain and truncated laws (top-k, top-p, min-p: the same operators, top-p's mask by the
    native kernel that is the sort's), over sessions of different γ, seeds and catch-up lengths."""
    import copy

    fast = DraftEngine(ModelRunner(copy.deepcopy(draft_model), linear_kernels="half"))
    slow = DraftEngine(ModelRunner(copy.deepcopy(draft_model), linear_kernels="half", whole_forward=False))
    prompts = [tokenizer(p)["input_ids"] for p in ("import os\n", "def walk(root):\n    for ", "class A:\n")]
    fields = {"temperature": 1.0, **LAWS[law]}
    laws = [SamplingParams(seed=100 * i + 7, **fields) for i in range(3)]
    starts = [0, 0, 0]
    for gammas in ((4, 1, 7), (2, 5, 3), (6, 6, 6)):
        feeds = [p if s == 0 else [7 + i] for i, (p, s) in enumerate(zip(prompts, starts))]
        jobs = [ProposeJob(CacheRef(f"t{i}", 1, s, f), g, law)
                for i, (s, f, g, law) in enumerate(zip(starts, feeds, gammas, laws))]
        assert fast._plain_sampled(jobs)
        passes = fast.forward_passes
        got, want = fast.propose(jobs), slow.propose(jobs)
        assert fast.forward_passes - passes == max(gammas)
        for a, b, g in zip(got, want, gammas):
            assert a.tokens == b.tokens and len(a.tokens) == g
            assert a.q.shape == b.q.shape == (g, fast.runner.vocab_size)
            assert torch.equal(a.q, b.q)
            assert torch.equal(a.q, a.q.half().float())  # fp16 values, as they travel
            assert a.cache_length == b.cache_length
        if law not in ("t1", "t0.7"):  # the law cuts: the draft distributions leave tokens out
            assert all((a.q == 0).any() for a in got)
        assert fast.fed_tokens == slow.fed_tokens
        for i in range(3):
            ca, cb = fast.sessions._sessions[f"t{i}"].cache, slow.sessions._sessions[f"t{i}"].cache
            assert ca.length == cb.length
            assert torch.allclose(ca.kv[:, :, : ca.length], cb.kv[:, :, : cb.length], atol=1e-5)
        starts = [s + len(f) for s, f in zip(starts, feeds)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shaped_batches_drafted_in_one_native_call_are_the_step_by_step_loops(draft_model, tokenizer, temperature):
    """Shaping jobs take the native draft too (each step's row shaped in the call by the
    session's ids, its fed tokens and the tokens drafted before): the same tokens (and at
    t = 1 the same fp16 distributions to the bit) as the engine's step loop, for a batch of
    an unshaped job, a penalised one and a biased one with tokens banned for its first steps,
    over rounds in which their prefixes grow."""
    import copy

    fast = DraftEngine(ModelRunner(copy.deepcopy(draft_model), linear_kernels="half"))
    slow = DraftEngine(ModelRunner(copy.deepcopy(draft_model), linear_kernels="half", whole_forward=False))
    prompts = [tokenizer(p)["input_ids"] for p in ("import os\n", "def walk(root):\n    for ", "class A:\n")]
    plain = SamplingParams(temperature, seed=11)
    # what the draft says first for each prompt, banned and biased against to bite
    firsts = [j.tokens[0] for j in fast.propose([ProposeJob(CacheRef(f"p{i}", 1, 0, p), 1, plain)
                                                 for i, p in enumerate(prompts)])]
    laws = [plain,
            SamplingParams(temperature, seed=12, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4,
                           penalty_start=len(prompts[1]) - 3),
            SamplingParams(temperature, seed=13, logit_bias=((firsts[2], -3.0), (5, 2.0)),
                           banned_ids=(firsts[2], 0), banned_until=len(prompts[2]) + 3)]
    starts, shaped_tokens = [0, 0, 0], []
    for gammas in ((4, 5, 6), (3, 6, 2)):
        feeds = [p if s == 0 else [7 + i] for i, (p, s) in enumerate(zip(prompts, starts))]
        jobs = [ProposeJob(CacheRef(f"s{i}", 1, s, f), g, law)
                for i, (s, f, g, law) in enumerate(zip(starts, feeds, gammas, laws))]
        assert fast._plain_greedy(jobs) if temperature == 0 else fast._plain_sampled(jobs)
        passes = fast.forward_passes
        got, want = fast.propose(jobs), slow.propose(jobs)
        assert fast.forward_passes - passes == max(gammas)  # one native call, not the step loop
        for a, b in zip(got, want):
            assert a.tokens == b.tokens and a.cache_length == b.cache_length
            assert (a.q is None and b.q is None) if temperature == 0 else torch.equal(a.q, b.q)
        for i in range(3):
            ca, cb = fast.sessions._sessions[f"s{i}"].cache, slow.sessions._sessions[f"s{i}"].cache
            assert (ca.ids[: ca.length] == cb.ids[: cb.length]).all()
        shaped_tokens.append(got[2].tokens)
        starts = [s + len(f) for s, f in zip(starts, feeds)]
    assert firsts[2] not in shaped_tokens[0][:3]  # banned for those positions


def test_only_plain_sampled_jobs_take_the_native_draw(draft_model):
    engine = DraftEngine(ModelRunner(draft_model, linear_kernels="half"))
    ref = CacheRef("x", 1, 0, [1, 2])
    t1 = SamplingParams(1.0, seed=3)
    plain = ProposeJob(ref, 4, t1)
    assert engine._plain_sampled([plain, ProposeJob(ref, 2, SamplingParams(1.0, seed=4))])
    cut = SamplingParams(0.8, top_k=30, top_p=0.9, min_p=0.1, seed=3)
    assert engine._plain_sampled([ProposeJob(ref, 4, cut), ProposeJob(ref, 2, cut)])  # one law, however cut
    assert not engine._plain_sampled([])
    for other in (ProposeJob(ref, 4, SamplingParams(1.0, top_p=0.9, seed=3)),  # another law beside it
                  ProposeJob(ref, 4, SamplingParams(1.0, top_k=50, seed=3)),
                  ProposeJob(ref, 4, SamplingParams(1.0, seed=3, min_p=0.05)),
                  ProposeJob(ref, 4, t1, guess_bonus=True),  # a pre-draft's bonus guess
                  ProposeJob(ref, 4, t1, stop_below=0.1),
                  ProposeJob(ref, 4, SamplingParams(0.7, seed=3)),  # another temperature beside t = 1
                  ProposeJob(ref, 4, SamplingParams(0.0))):  # greedy beside sampled
        assert not engine._plain_sampled([plain, other])


def test_a_penalised_proposal_drafts_from_the_penalised_law_counting_what_native_steps_fed(draft_model):
    """A greedy proposal with penalties drafts the argmaxes of the penalised rows, counting
    the session's tokens fed before by a plain (native) proposal too: its cache keeps the
    ids of every position however it was fed."""
    from tests.specdec.test_penalties import reference

    engine = DraftEngine(ModelRunner(draft_model, linear_kernels="half"))
    seed = [5, 9, 5, 9, 5, 9, 5, 9, 5]
    loop = engine.propose([ProposeJob(CacheRef("u", 1, 0, seed), 8, SamplingParams(0.0))])[0].tokens
    prompt = seed + loop + loop  # what the draft says next repeats itself: the penalty has work to do
    plain = engine.propose([ProposeJob(CacheRef("s", 1, 0, prompt), 3, SamplingParams(0.0))])[0]
    assert plain.cache_length == len(prompt) + 2  # the steps fed all but the last drafted token
    context = prompt + plain.tokens
    params = SamplingParams(0.0, repetition_penalty=1.8, presence_penalty=0.5, penalty_start=len(prompt))
    got = engine.propose([ProposeJob(CacheRef("s", 1, len(context) - 1, context[-1:]), 5, params)])[0]
    expected = list(context)
    with torch.no_grad():
        for _ in range(5):
            row = draft_model(input_ids=torch.tensor([expected])).logits[0, -1].float()
            expected.append(int(reference(row, expected, len(prompt), params).argmax()))
    assert got.tokens == expected[len(context):]
    unpenalised = engine.propose([ProposeJob(CacheRef("t", 1, 0, context), 5, SamplingParams(0.0))])[0]
    assert unpenalised.tokens != got.tokens  # the penalty bites here


def test_a_growing_session_evicts_an_idle_one_under_the_cache_budget(draft_model):
    """--max-cache-mb holds as the draft's caches grow too: proposals whose session grows
    past the budget evict the idle session, and draft as an engine without a budget does."""
    runner = ModelRunner(draft_model)
    budget = DraftEngine(runner, max_cache_bytes=700 * runner.bytes_per_token())
    free = DraftEngine(runner)
    greedy = SamplingParams(temperature=0.0)
    drafts = {budget: [], free: []}
    for engine in (budget, free):
        engine.propose([ProposeJob(CacheRef("idle", 1, 0, [5] * 20), 4, greedy)])
        committed = [7] * 30
        for _ in range(12):  # 30 tokens, then 44 a round: the cache grows to 672 positions
            start = len(committed) - (30 if not drafts[engine] else 44)
            proposal = engine.propose([ProposeJob(CacheRef("long", 1, start, committed[start:]), 4, greedy)])[0]
            drafts[engine].append(proposal.tokens)
            committed += proposal.tokens + [3] * 40
    assert drafts[budget] == drafts[free]
    assert "idle" not in budget.sessions and budget.sessions.evictions == 1 and "idle" in free.sessions
    assert budget.sessions.cache_bytes <= budget.sessions.max_cache_bytes < free.sessions.cache_bytes


def test_a_refused_proposal_leaves_no_cycle_holding_the_batch(draft_model):
    import gc

    from specdec.errors import InvalidRequest

    engine = DraftEngine(ModelRunner(draft_model))
    greedy = SamplingParams(temperature=0.0)
    gc.collect()
    gc.disable()
    try:
        out = engine.propose([ProposeJob(CacheRef("a", 1, 0, [5] * 20), 4, greedy),
                              ProposeJob(CacheRef("b", 1, 0, [5] * 20), 99, greedy)])  # γ out of range
        assert isinstance(out[1], InvalidRequest) and out[1].__traceback__ is None
        del out
        assert gc.collect() == 0
    finally:
        gc.enable()
