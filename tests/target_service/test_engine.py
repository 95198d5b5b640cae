"""TargetEngine's batched decision: one batch of mixed sessions (greedy and sampled laws,
different γ, γ = 0) must reach, for each session, exactly the verdict the pure functions
of specdec.sampling give that session on its own rows."""
import pytest
import torch

from specdec import sampling
from specdec.errors import InvalidRequest
from specdec.model_runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sessions import CacheRef
from target_service.engine import TargetEngine, VerifyJob


def _alone(job: VerifyJob, rows: torch.Tensor, rule: str = "block") -> tuple[int, int, list[float] | None]:
    """The session's verdict by the tensor reference, and its keep chances: the block
    weights w_1..w_γ, or the token rule's running products of min(1, p/q)."""
    g = len(job.draft_tokens)
    first = job.ref.start + len(job.ref.tokens)
    p = sampling.logits_to_probs(rows, job.params).double()[None]
    q = job.q[None] if g else torch.zeros(1, 0, rows.shape[-1], dtype=torch.float64)
    res = sampling.verify(torch.tensor([job.draft_tokens], dtype=torch.long).view(1, g), q, p,
                          sampling.uniforms(job.params.seed, first, g, sampling.STREAM_ACCEPT)[None],
                          sampling.uniforms(job.params.seed, first, g + 1, sampling.STREAM_RESAMPLE)[None],
                          bonus_noise=sampling.bonus_noise([job.params.seed], [first + g], rows.shape[-1]),
                          rule=rule)
    if job.params.greedy:
        return int(res.accepted[0]), int(res.next_token[0]), None
    at = torch.arange(g), torch.tensor(job.draft_tokens, dtype=torch.long)
    p_x, q_x = p[0][at][None], q[0][at][None]
    if rule == "block":
        chances = sampling.block_weights(p_x, q_x)[0, 1:]
    else:
        chances = (p_x / q_x).clamp(max=1.0).cumprod(-1)[0]
    return int(res.accepted[0]), int(res.next_token[0]), chances.tolist()


@pytest.mark.parametrize("rule", sampling.RULES)
def test_a_mixed_batch_decides_each_session_as_if_alone(target_model, rule):
    engine = TargetEngine(ModelRunner(target_model), rule=rule)
    V = engine.runner.vocab_size
    g = torch.Generator().manual_seed(7)
    laws = [SamplingParams(0.0), SamplingParams(1.0, seed=3), SamplingParams(0.8, 20, 1.0, 4),
            SamplingParams(0.0), SamplingParams(1.0, 0, 0.9, 5), SamplingParams(1.0, seed=6)]
    gammas = [4, 3, 0, 1, 5, 2]
    deepest = 0
    for trial in range(20):
        jobs = []
        for b, (params, gamma) in enumerate(zip(laws, gammas)):
            q = torch.softmax(torch.randn(gamma, V, generator=g, dtype=torch.float64) * 3, -1)
            draft = torch.multinomial(q, 1, generator=g).view(-1).tolist() if gamma else []
            jobs.append(VerifyJob(CacheRef(f"s{b}", 1, 10 * b + trial, [5, 6]), draft, q if gamma else None, params))
        logits = torch.randn(sum(gamma + 1 for gamma in gammas), V, generator=g) * 3
        # make some drafts match the target, so that acceptance runs deep
        row = 0
        for job in jobs:
            for i, token in enumerate(job.draft_tokens):
                if (trial + i) % 2 == 0:
                    logits[row + i, token] += 20
            row += len(job.draft_tokens) + 1
        got = engine._decide(jobs, logits)
        row = 0
        for job, verdict in zip(jobs, got):
            n = len(job.draft_tokens) + 1
            want = _alone(job, logits[row : row + n], rule)
            assert verdict[:2] == want[:2], (trial, job.params, len(job.draft_tokens))
            if want[2] is None:
                assert verdict[2] is None
            else:
                assert verdict[2] == pytest.approx(want[2], rel=1e-9, abs=1e-12)
            row += n
            deepest = max(deepest, verdict[0])
    assert deepest >= 2  # the test reached past the first draft token


def _liking(jobs: list[VerifyJob], trial: int, V: int, g: torch.Generator) -> torch.Tensor:
    """The batch's target logits, random but for most draft tokens, which the target likes
    (by a margin that varies with the trial): deep and full acceptances, bonuses and stops."""
    logits = torch.randn(sum(len(job.draft_tokens) + 1 for job in jobs), V, generator=g) * 3
    row = 0
    for job in jobs:
        for i, token in enumerate(job.draft_tokens):
            if (trial + i) % 3:
                logits[row + i, token] += 8 + trial % 4
        row += len(job.draft_tokens) + 1
    return logits


def test_native_block_verdicts_are_the_operators_verdicts_to_the_bit(target_model, monkeypatch):
    """Where specdec.native is loaded, sampled sessions under the block rule are decided in
    one call of its block_verdicts; without it, by torch's operators. Both must give the
    same kept lengths, tokens and weights exactly, over batches whose drafts the target
    often likes (deep and full acceptances, bonuses), truncated laws whose residuals have
    zeros, γ = 0 and seeds above 2^63 (hashed unsigned)."""
    from specdec import native

    engine = TargetEngine(ModelRunner(target_model))
    kernels = native.loaded()
    if kernels is None:
        pytest.skip(f"specdec.native is unavailable here: {native.unavailable_reason()}")
    V = engine.runner.vocab_size
    g = torch.Generator().manual_seed(11)
    laws = [SamplingParams(1.0, seed=2**64 - 5), SamplingParams(0.7, 0, 1.0, 9), SamplingParams(1.0, 40, 1.0, 2**63),
            SamplingParams(1.0, 0, 0.8, 1), SamplingParams(1.3, seed=12)]
    full = stopped = 0
    for trial in range(40):
        gammas = [(trial + b) % 6 for b in range(len(laws))]
        jobs = []
        for b, (params, gamma) in enumerate(zip(laws, gammas)):
            q = torch.softmax(torch.randn(gamma, V, generator=g, dtype=torch.float64) * 3, -1)
            q[:, : V // 3] = 0.0  # zeros in the draft's law, where the target has mass
            q = q / q.sum(-1, keepdim=True)
            draft = torch.multinomial(q, 1, generator=g).view(-1).tolist() if gamma else []
            jobs.append(VerifyJob(CacheRef(f"s{b}", 1, 7 * trial + b, [5]), draft, q if gamma else None, params))
        logits = _liking(jobs, trial, V, g)
        natively = engine._decide(jobs, logits)
        with monkeypatch.context() as patch:
            patch.setattr(native, "loaded", lambda: None)
            by_operators = engine._decide(jobs, logits)
        assert natively == by_operators, trial
        full += sum(1 for job, (n, _, _) in zip(jobs, natively) if job.draft_tokens and n == len(job.draft_tokens))
        stopped += sum(1 for job, (n, _, _) in zip(jobs, natively) if n < len(job.draft_tokens))
    assert full >= 10 and stopped >= 10  # both the bonus and the recovery were compared
    with pytest.raises(RuntimeError, match="draft tokens expected"):
        kernels.block_verdicts(torch.zeros(2, V), [0], [1], [], [torch.zeros(1, V, dtype=torch.float64)], [1], [0])


def test_greedy_verification_needs_no_distributions_and_sampling_does(target_model):
    """A greedy draft travels without its distributions: the verdict is the one its one-hot
    distributions would give. A sampled draft without them is refused, clearly."""
    engine = TargetEngine(ModelRunner(target_model))
    V = engine.runner.vocab_size
    draft = [17, 42, 99]
    one_hot = torch.zeros(len(draft), V, dtype=torch.float64)
    one_hot[torch.arange(len(draft)), torch.tensor(draft)] = 1.0
    verdicts = engine.verify([VerifyJob(CacheRef("bare", 1, 0, [5, 6, 7]), draft, None, SamplingParams(0.0)),
                              VerifyJob(CacheRef("hot", 1, 0, [5, 6, 7]), draft, one_hot, SamplingParams(0.0))])
    assert (verdicts[0].accepted, verdicts[0].next_token) == (verdicts[1].accepted, verdicts[1].next_token)
    refused = engine.verify([VerifyJob(CacheRef("t1", 1, 0, [5, 6, 7]), draft, None, SamplingParams(1.0, seed=1))])[0]
    assert isinstance(refused, InvalidRequest) and "needs the draft's distributions" in str(refused)


def test_each_verdict_reports_the_rows_of_the_forward_it_shared(target_model):
    """The orchestrator prices γ under load on the forward's cost by rows, so every
    session of a batch learns the batch's rows: its fed tokens and everyone else's; a
    refused job adds none."""
    engine = TargetEngine(ModelRunner(target_model))
    jobs = [VerifyJob(CacheRef("five", 1, 0, [5, 6, 7, 8, 9]), [], None, SamplingParams(0.0)),
            VerifyJob(CacheRef("seven", 1, 0, [5, 6, 7, 8, 9, 10, 11]), [17, 42], None, SamplingParams(0.0)),
            VerifyJob(CacheRef("bad", 1, 0, [5]), [engine.runner.vocab_size], None, SamplingParams(0.0))]
    first, second, refused = engine.verify(jobs)
    assert isinstance(refused, InvalidRequest)
    assert (first.batch_size, first.batch_tokens) == (second.batch_size, second.batch_tokens) == (2, 5 + 7 + 2)
    alone = engine.verify([VerifyJob(CacheRef("five", 1, 5, [first.next_token]), [3, 4, 5], None,
                                     SamplingParams(0.0))])[0]
    assert (alone.batch_size, alone.batch_tokens) == (1, 4)


def test_logprobs_are_the_target_forwards_for_the_kept_tokens_only_where_asked(target_model):
    """A batch of sessions asking and not asking, greedy and sampled: each asking session
    gets, for every token it keeps (accepted drafts, then the next token), the log-softmax
    of a plain forward of the target over its text at that position; the others nothing."""
    engine = TargetEngine(ModelRunner(target_model))
    V = engine.runner.vocab_size
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, V, (6 + b,), generator=g).tolist() for b in range(4)]
    laws = [SamplingParams(0.0), SamplingParams(1.0, seed=5), SamplingParams(0.0), SamplingParams(1.0, seed=9)]
    asks = [(True, 3), (True, 0), (False, 0), (True, 20)]
    jobs = []
    for b, (prompt, params, (asked, top)) in enumerate(zip(prompts, laws, asks)):
        draft = torch.randint(0, V, (3,), generator=g).tolist()
        q = torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64), -1)
        jobs.append(VerifyJob(CacheRef(f"s{b}", 1, 0, prompt), draft, None if params.greedy else q, params,
                              asked, top))
    verdicts = engine.verify(jobs)
    for job, verdict, (asked, top) in zip(jobs, verdicts, asks):
        if not asked:
            assert verdict.logprobs is None
            continue
        kept = job.draft_tokens[:verdict.accepted] + [verdict.next_token]
        text = torch.tensor(job.ref.tokens + kept)
        with torch.no_grad():
            ref = torch.log_softmax(target_model(input_ids=text[None]).logits[0].float(), -1)
        rows = ref[len(job.ref.tokens) - 1: len(text) - 1]
        assert len(verdict.logprobs) == len(kept)
        assert torch.allclose(torch.tensor(verdict.logprobs), rows[torch.arange(len(kept)), torch.tensor(kept)],
                              atol=1e-4)
        assert len(verdict.top_ids) == len(verdict.top_logprobs) == top * len(kept)
        if top:
            values, ids = rows.topk(top, dim=-1)
            assert torch.tensor(verdict.top_ids).view(-1, top).tolist() == ids.tolist()
            assert torch.allclose(torch.tensor(verdict.top_logprobs).view(-1, top), values, atol=1e-4)
    refused = engine.verify([VerifyJob(CacheRef("x", 1, 0, [5]), [], None, SamplingParams(0.0), True, 21)])[0]
    assert isinstance(refused, InvalidRequest) and "top_logprobs" in str(refused)


def test_fed_tokens_logprobs_come_from_every_row_and_leave_the_verdicts_as_they_were(target_model):
    """Sessions asking for their fed tokens' log-probabilities (a prompt's) get those of a
    plain forward over them, after the first; every session's verdict is the one a batch
    asking for none gives."""
    V = ModelRunner(target_model).vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (9 + 3 * b,), generator=g).tolist() for b in range(3)]
    drafts = [torch.randint(0, V, (gamma,), generator=g).tolist() for gamma in (3, 0, 2)]
    laws = [SamplingParams(0.0), SamplingParams(1.0, seed=2), SamplingParams(1.0, seed=4)]
    qs = [torch.softmax(torch.randn(len(d), V, generator=g, dtype=torch.float64), -1) for d in drafts]

    def jobs(fed: list[bool]) -> list[VerifyJob]:
        return [VerifyJob(CacheRef(f"s{b}", 1, 0, prompts[b]), drafts[b], None if laws[b].greedy else qs[b],
                          laws[b], False, 2 if fed[b] else 0, fed[b]) for b in range(3)]

    asked = TargetEngine(ModelRunner(target_model)).verify(jobs([True, False, True]))
    plain = TargetEngine(ModelRunner(target_model)).verify(jobs([False, False, False]))
    for b, (a, p) in enumerate(zip(asked, plain)):
        assert (a.accepted, a.next_token, a.cache_length) == (p.accepted, p.next_token, p.cache_length)
        if b == 1:
            assert a.fed_logprobs is None
            continue
        with torch.no_grad():
            ref = torch.log_softmax(target_model(input_ids=torch.tensor([prompts[b]])).logits[0].float(), -1)[:-1]
        tokens = torch.tensor(prompts[b][1:])
        assert len(a.fed_logprobs) == len(prompts[b]) - 1
        assert torch.allclose(torch.tensor(a.fed_logprobs), ref[torch.arange(len(tokens)), tokens], atol=1e-4)
        values, ids = ref.topk(2, dim=-1)
        assert torch.tensor(a.fed_top_ids).view(-1, 2)[:, 0].tolist() == ids[:, 0].tolist()
        assert torch.allclose(torch.tensor(a.fed_top_logprobs).view(-1, 2), values, atol=1e-4)


def test_processed_logprobs_are_the_sampled_laws_beside_raw_ones_in_one_batch(target_model):
    """Sessions asking for processed log-probabilities get those of the law they sample from
    (temperature, top-k, top-p, min-p applied to a plain forward's logits: −inf outside it;
    greedy: 0 at the argmax), for kept and fed tokens, in a batch with a session asking for
    raw ones; the verdicts are those of a batch asking for none."""
    V = ModelRunner(target_model).vocab_size
    g = torch.Generator().manual_seed(23)
    prompts = [torch.randint(0, V, (7 + 2 * b,), generator=g).tolist() for b in range(3)]
    drafts = [torch.randint(0, V, (gamma,), generator=g).tolist() for gamma in (3, 2, 0)]
    laws = [SamplingParams(0.8, top_k=40, top_p=0.9, seed=3, min_p=0.05), SamplingParams(1.0, seed=8),
            SamplingParams(0.0)]
    qs = [torch.softmax(torch.randn(len(d), V, generator=g, dtype=torch.float64), -1) for d in drafts]
    processed = [True, False, True]

    def jobs(asked: bool) -> list[VerifyJob]:
        return [VerifyJob(CacheRef(f"s{b}", 1, 0, prompts[b]), drafts[b], None if laws[b].greedy else qs[b], laws[b],
                          asked, 3 if asked else 0, asked and b != 1, asked and processed[b]) for b in range(3)]

    asked = TargetEngine(ModelRunner(target_model)).verify(jobs(True))
    plain = TargetEngine(ModelRunner(target_model)).verify(jobs(False))
    for b, (a, p) in enumerate(zip(asked, plain)):
        assert (a.accepted, a.next_token, a.cache_length) == (p.accepted, p.next_token, p.cache_length)
        kept = drafts[b][:a.accepted] + [a.next_token]
        with torch.no_grad():
            logits = target_model(input_ids=torch.tensor([prompts[b] + kept])).logits[0, :-1].float()
        ref = torch.log(sampling.logits_to_probs(logits, laws[b])) if processed[b] else torch.log_softmax(logits, -1)
        tokens = torch.tensor(prompts[b][1:] + kept)
        want = ref[torch.arange(len(tokens)), tokens]
        got = torch.tensor((a.fed_logprobs or []) + a.logprobs)
        if b == 1:  # raw, kept tokens only
            want, ref = want[-len(kept):], ref[-len(kept):]
        assert torch.isfinite(got[-len(kept):]).all()  # kept tokens always lie in the law; fed ones need not
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.allclose(got[torch.isfinite(want)], want[torch.isfinite(want)], atol=1e-4)
        top = torch.tensor((a.fed_top_logprobs or []) + a.top_logprobs).view(-1, 3)
        values = ref.topk(3, dim=-1).values
        assert torch.equal(torch.isinf(top), torch.isinf(values))
        assert torch.allclose(top[torch.isfinite(top)], values[torch.isfinite(values)], atol=1e-4)
        if laws[b].greedy:  # one-hot: the argmax's log-probability is 0, every other −inf
            assert a.logprobs == [0.0] * len(kept) and torch.isinf(top[:, 1:]).all()


def test_sessions_that_grow_evict_idle_ones_under_the_cache_budget(target_model):
    """A replica's --max-cache-mb holds while its sessions decode, not only when one is
    created: a session growing past the budget evicts the idle one, whose next call is
    told to rebuild, and the verdicts are those of an engine without a budget."""
    from specdec.errors import CacheMismatch

    runner = ModelRunner(target_model)
    per_position = runner.bytes_per_token()
    budget = TargetEngine(runner, max_cache_bytes=700 * per_position)
    free = TargetEngine(runner)
    greedy = SamplingParams(temperature=0.0)
    for engine in (budget, free):
        assert engine.verify([VerifyJob(CacheRef("idle", 1, 0, [5] * 20), [], None, greedy)])[0].cache_length == 20
    state, verdicts = {e: ([7] * 30, 0) for e in (budget, free)}, {budget: [], free: []}
    for _ in range(12):  # 30 tokens, then 41-49 more a round: the cache grows to 672 positions
        for engine in (budget, free):
            committed, held = state[engine]
            verdict = engine.verify([VerifyJob(CacheRef("long", 1, held, committed[held:]), [9] * 8, None,
                                               greedy)])[0]
            verdicts[engine].append((verdict.accepted, verdict.next_token))
            # the kept tokens, and 40 more committed as if from other rounds
            state[engine] = (committed + [9] * verdict.accepted + [verdict.next_token] + [3] * 40,
                             verdict.cache_length)
    assert verdicts[budget] == verdicts[free]
    assert "idle" not in budget.sessions and budget.sessions.evictions == 1 and "idle" in free.sessions
    assert budget.sessions.cache_bytes <= budget.sessions.max_cache_bytes < free.sessions.cache_bytes
    again = budget.verify([VerifyJob(CacheRef("idle", 1, 20, [6]), [], None, greedy)])[0]
    assert isinstance(again, CacheMismatch) and "rebuild from start 0" in str(again)


def test_a_refused_job_leaves_no_cycle_holding_the_batch(target_model):
    """A refusal is returned as a value: with its traceback it held the verify frame (the
    batch's logits, on a GPU tens of MB) in a reference cycle until the cyclic GC ran."""
    import gc

    from specdec.errors import CacheMismatch

    engine = TargetEngine(ModelRunner(target_model))
    greedy = SamplingParams(temperature=0.0)
    engine.verify([VerifyJob(CacheRef("a", 1, 0, [5] * 20), [], None, greedy)])
    gc.collect()
    gc.disable()
    try:
        out = engine.verify([VerifyJob(CacheRef("a", 1, 20, [7]), [9] * 4, None, greedy),
                             VerifyJob(CacheRef("b", 1, 5, [3]), [], None, greedy)])  # b is not held
        assert isinstance(out[1], CacheMismatch) and out[1].__traceback__ is None
        del out
        assert gc.collect() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("rule", sampling.RULES)
def test_rows_kept_fp16_give_the_decoded_rows_verdicts_to_the_bit(target_model, rule):
    """A GPU's servicer keeps the draft's rows fp16 beside their sums (specdec/draft_rows.py);
    the verdicts read the same probabilities, so they are the same to the bit as over the
    decoded float64 rows, natively decided or not, deep and full acceptances alike."""
    from specdec.wire import decode, decode_half, encode, quantize

    engine = TargetEngine(ModelRunner(target_model), rule=rule)
    V = engine.runner.vocab_size
    g = torch.Generator().manual_seed(5)
    laws = [SamplingParams(1.0, seed=4), SamplingParams(0.7, 0, 1.0, 9), SamplingParams(1.0, 40, 1.0, 2),
            SamplingParams(0.0), SamplingParams(1.0, 0, 0.8, 1)]
    full = stopped = 0
    for trial in range(40):
        gammas = [(trial + b) % 6 for b in range(len(laws))]
        decoded, kept = [], []
        for b, (params, gamma) in enumerate(zip(laws, gammas)):
            q16 = quantize(torch.softmax(torch.randn(gamma, V, generator=g) * 3, -1))
            draft = torch.multinomial(q16, 1, generator=g).view(-1).tolist() if gamma else []
            ref = CacheRef(f"s{b}", 1, 7 * trial + b, [5])
            enc = encode(q16) if gamma else None
            decoded.append(VerifyJob(ref, draft, decode(enc, gamma) if gamma else None, params))
            kept.append(VerifyJob(ref, draft, decode_half(enc, gamma) if gamma else None, params))
        logits = _liking(decoded, trial, V, g)
        want = engine._decide(decoded, logits)
        assert engine._decide(kept, logits) == want, trial
        engine.native_verdicts = False
        assert engine._decide(decoded, logits) == want, trial
        engine.native_verdicts = True
        full += sum(1 for job, (n, _, _) in zip(decoded, want) if job.draft_tokens and n == len(job.draft_tokens))
        stopped += sum(1 for job, (n, _, _) in zip(decoded, want) if n < len(job.draft_tokens))
    assert full >= 10 and stopped >= 10  # both the bonus and the recovery were compared
