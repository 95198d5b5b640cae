"""The sampling core: greedy cases, seeded determinism, and statistical losslessness on
synthetic distributions (chi-square at a fixed seed, so the verdict is reproducible)."""
import itertools
import math
import random

import pytest
import torch

from specdec import encoding, sampling, wire
from specdec.sampling import SamplingParams, logits_to_probs, sample_from, verify, verify_greedy
from tests.stats import chisquare_pvalue

V = 12


def one_hot(ids, v=V):
    return torch.nn.functional.one_hot(torch.tensor(ids), v).double()


def test_perfect_match_accepts_all_and_adds_bonus():
    p = one_hot([3, 5, 7, 1])[None]  # [1, γ+1, V]
    q = one_hot([3, 5, 7])[None]
    res = verify(torch.tensor([[3, 5, 7]]), q, p, torch.zeros(1, 3), torch.zeros(1, 4))
    assert res.accepted.tolist() == [3] and res.next_token.tolist() == [1]


def test_early_mismatch_recovers_target_argmax():
    p = one_hot([3, 9, 7, 1])[None]
    q = one_hot([3, 5, 7])[None]
    res = verify(torch.tensor([[3, 5, 7]]), q, p, torch.rand(1, 3), torch.rand(1, 4))
    assert res.accepted.tolist() == [1] and res.next_token.tolist() == [9]


def test_per_session_gamma_padding():
    p = one_hot([3, 5, 7, 1]).expand(2, 4, V)
    q = one_hot([3, 5, 7]).expand(2, 3, V)
    res = verify(torch.tensor([[3, 5, 7]] * 2), q, p, torch.zeros(2, 3), torch.zeros(2, 4), torch.tensor([3, 1]))
    assert res.accepted.tolist() == [3, 1]
    assert res.next_token.tolist() == [1, 5]  # session 2: bonus after its single draft token


def test_greedy_probs_are_one_hot_of_argmax():
    logits = torch.randn(4, V)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.all(probs.sum(-1) == 1)


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (logits_to_probs(logits, SamplingParams(top_k=2)) > 0).sum() == 2
    probs = logits_to_probs(logits, SamplingParams(top_p=0.7))
    full = torch.softmax(logits, -1)
    assert full[0] < 0.7 < full[:2].sum()  # the smallest set reaching 0.7 is the top two
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_likeliest():
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, -3.0])
    full = torch.softmax(logits, -1)
    probs = logits_to_probs(logits, SamplingParams(min_p=0.1))
    assert (probs > 0).tolist() == (full >= 0.1 * full[0]).tolist() == [True, True, True, False, False]
    assert torch.allclose(probs[:3], full[:3] / full[:3].sum())
    assert torch.equal(logits_to_probs(logits, SamplingParams(min_p=1.0)) > 0, full == full.max())
    assert SamplingParams(min_p=0.1).truncates and not SamplingParams().truncates


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.3), (1.3, 20, 1.0, 0.1), (1.0, 0, 0.9, 0.1), (0.8, 30, 0.95, 0.02),
    (1.0, 0, 0.5, 0.0)])
def test_the_laws_are_transformers_samplers(temperature, top_k, top_p, min_p):
    """Temperature, top-k, top-p and min-p as transformers' warpers chain them (the order
    `generate()` applies them in), on rows of a real vocabulary's size."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(5)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    theirs = torch.softmax(scores, -1)
    ours = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_uniforms_are_seeded_and_stateless():
    a = sampling.uniforms(7, 100, 5, sampling.STREAM_ACCEPT)
    assert torch.equal(a, sampling.uniforms(7, 100, 5, sampling.STREAM_ACCEPT))
    assert not torch.equal(a, sampling.uniforms(8, 100, 5, sampling.STREAM_ACCEPT))
    assert not torch.equal(a, sampling.uniforms(7, 100, 5, sampling.STREAM_DRAFT))
    many = sampling.uniforms(1, 0, 20000, sampling.STREAM_DRAFT)
    assert 0 <= float(many.min()) and float(many.max()) < 1 and abs(float(many.mean()) - 0.5) < 0.01


def test_vectorised_uniforms_equal_the_scalar_hash():
    """The batch's uniforms (one numpy hash over many seeds and positions) are exactly the
    scalar counter-based ones: a seeded request draws the same numbers in any batch."""
    rng = random.Random(5)
    seeds = [0, 1, -1, 2**64 - 1, 2**64 + 3, 2**63] + [rng.getrandbits(64) for _ in range(200)]
    positions = [rng.randrange(0, 1 << 20) for _ in seeds]
    for stream in (sampling.STREAM_DRAFT, sampling.STREAM_ACCEPT, sampling.STREAM_RESAMPLE):
        for n in (len(seeds), sampling.VECTOR_FROM, sampling.VECTOR_FROM - 1, 1, 0):  # numpy and scalar paths
            got = sampling.uniforms_at(seeds[:n], positions[:n], stream)
            assert got.dtype == torch.float64 and len(got) == n
            assert got.tolist() == [sampling.uniform(s, p, stream) for s, p in zip(seeds[:n], positions[:n])]


def test_sample_from_never_picks_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    u = torch.linspace(0, 0.999999, 1000)
    picks = sample_from(probs.expand(1000, 5), u)
    assert set(picks.tolist()) == {1, 3}


def simulate(p_table, q_table, gamma, trials, gen, positions_needed=2, race_bonus=False, rule="block"):
    """Run speculative rounds for `trials` independent sequences whose target and draft
    laws depend only on the position: p_table/q_table [P, V]. Returns [trials, needed].
    race_bonus: bonuses after fully accepted drafts by the exponential race, as the engine draws them."""
    out = torch.full((trials, positions_needed), -1, dtype=torch.long)
    length = torch.zeros(trials, dtype=torch.long)
    P = p_table.shape[0]
    while bool((length < positions_needed).any()):
        idx = (length[:, None] + torch.arange(gamma + 1)).clamp(max=P - 1)  # [B, γ+1]
        p = p_table[idx]
        q = q_table[idx[:, :gamma]]
        draft = sample_from(q, torch.rand(trials, gamma, generator=gen, dtype=torch.float64))
        noise = None
        if race_bonus:
            noise = -torch.log(torch.rand(trials, p.shape[-1], generator=gen, dtype=torch.float64))
        res = verify(draft, q, p, torch.rand(trials, gamma, generator=gen, dtype=torch.float64),
                     torch.rand(trials, gamma + 1, generator=gen, dtype=torch.float64), bonus_noise=noise, rule=rule)
        for j in range(gamma + 1):
            tok = torch.where(j < res.accepted, draft[:, min(j, gamma - 1)], res.next_token)
            valid = (j <= res.accepted) & (length + j < positions_needed)
            pos = (length + j).clamp(max=positions_needed - 1)
            out[valid, pos[valid]] = tok[valid]
        length = length + res.accepted + 1
    return out


CASES = [
    # (temperature, top_k, top_p, how the draft relates to the target; min_p 0.15 where it is "min_p")
    (1.0, 0, 1.0, "independent"),
    (1.0, 0, 1.0, "min_p"),
    (0.7, 0, 1.0, "independent"),
    (1.3, 5, 1.0, "independent"),
    (1.0, 0, 0.8, "independent"),
    (1.0, 0, 1.0, "draft_mass_where_target_none"),
    (1.0, 0, 1.0, "target_mass_where_draft_none"),
]


@pytest.mark.parametrize("rule", sampling.RULES)
@pytest.mark.parametrize("bonus", ["inverse-cdf", "race"])
@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("temperature,top_k,top_p,relation", CASES)
def test_output_distribution_is_the_targets(gamma, temperature, top_k, top_p, relation, bonus, rule):
    gen = torch.Generator().manual_seed(1000 * gamma + CASES.index((temperature, top_k, top_p, relation))
                                        + 7 * (bonus == "race") + 31 * (rule == "token"))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=0.15 * (relation == "min_p"))
    positions = 3
    p_logits = torch.randn(positions, V, generator=gen) * 1.5
    q_logits = torch.randn(positions, V, generator=gen) * 1.5
    p = logits_to_probs(p_logits, params).double()
    q = logits_to_probs(q_logits, params).double()
    if relation == "draft_mass_where_target_none":
        p = logits_to_probs(p_logits, SamplingParams(temperature=temperature, top_k=4)).double()
    if relation == "target_mass_where_draft_none":
        q = logits_to_probs(q_logits, SamplingParams(temperature=temperature, top_k=3)).double()
    trials = 40000
    out = simulate(p, q, gamma, trials, gen, positions_needed=positions, race_bonus=bonus == "race", rule=rule)
    for pos in range(positions):
        observed = torch.bincount(out[:, pos], minlength=V).double()
        support = p[pos] > 0
        assert observed[~support].sum() == 0, "a token the target never emits came out"
        if int(support.sum()) == 1:
            continue  # one possible token: the check above is the whole test
        expected = p[pos][support] / p[pos][support].sum() * observed.sum()
        pvalue = chisquare_pvalue(observed[support], expected)
        assert pvalue > 1e-3, f"position {pos}: chi-square p={pvalue:.2e}"


class ContextLaws:
    """Target and draft laws that depend on the whole prefix (a table per prefix), some
    of them equal, one-hot or with zeros where the other has mass: the cases where a
    verification rule could go wrong."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng, self.laws = vocab, random.Random(seed), {}

    def _draw(self, zeros: bool) -> list[float]:
        w = [self.rng.random() ** 2 for _ in range(self.vocab)]
        if zeros and self.rng.random() < 0.3:
            w[self.rng.randrange(self.vocab)] = 0.0
        return [x / sum(w) for x in w]

    def __call__(self, prefix: tuple) -> tuple[list[float], list[float]]:
        if prefix not in self.laws:
            kind, one = self.rng.random(), [0.0] * self.vocab
            one[self.rng.randrange(self.vocab)] = 1.0
            if kind < 0.25:
                p = self._draw(True)
                law = (p, list(p))
            elif kind < 0.35:
                law = (one, list(one))
            elif kind < 0.45:
                law = (one, self._draw(False))
            else:
                law = (self._draw(True), self._draw(False))
            self.laws[prefix] = law
        return self.laws[prefix]


def _round_law(laws: ContextLaws, draft: tuple, rule: str) -> list[tuple[float, tuple]]:
    """Exactly what one round of `rule` outputs after the draft tokens `draft` were drawn:
    (probability, tokens) pairs, from the sampling module's own functions."""
    G = len(draft)
    p = torch.tensor([laws(draft[:i])[0] for i in range(G + 1)], dtype=torch.float64)
    q = torch.tensor([laws(draft[:i])[1] for i in range(G)], dtype=torch.float64)
    p_x, q_x = p[torch.arange(G), list(draft)], q[torch.arange(G), list(draft)]
    gammas = torch.tensor([G])
    if rule == "block":
        w = sampling.block_weights(p_x[None], q_x[None])
        mass = torch.zeros(1, G + 1, dtype=torch.float64)
        mass[0, 1:G] = sampling.residual_mass(w[0, 1:G], p[1:G], q[1:G])
        h = sampling.stop_probabilities(w, mass, gammas)[0].tolist()
        stop = [1.0] + h  # P(prefix t kept) = h_t · Π_{j > t} (1 − h_j); the empty prefix: h_0 = 1
        kept = [stop[t] * math.prod(1 - x for x in h[t:]) for t in range(G + 1)]
        weights = w[0].tolist()
    else:
        a = [min(1.0, x) for x in (p_x / q_x).tolist()]
        kept = [math.prod(a[:t]) * (1 - a[t] if t < G else 1.0) for t in range(G + 1)]
        weights = [1.0] * (G + 1)
    out = []
    for t, chance in enumerate(kept):
        if chance <= 0:
            continue
        law = p[t] if t == G else (weights[t] * p[t] - q[t]).clamp(min=0.0)
        if float(law.sum()) <= 0:
            law = p[t]
        law = law / law.sum()
        out += [(chance * float(law[y]), draft[:t] + (y,)) for y in range(len(law)) if law[y] > 0]
    return out


def _exact_output_law(laws: ContextLaws, gamma: int, rule: str) -> tuple[dict, float]:
    """The law of the first γ + 1 tokens (one round, then the target's own samples) over
    every possible draft, and the expected tokens a round."""
    vocab, out, tokens = laws.vocab, {}, 0.0
    for draft in itertools.product(range(vocab), repeat=gamma):
        chance = 1.0
        for i, x in enumerate(draft):
            chance *= laws(draft[:i])[1][x]
        if chance == 0:
            continue
        for pr, produced in _round_law(laws, draft, rule):
            tokens += chance * pr * len(produced)
            tails = {produced: 1.0}
            while len(next(iter(tails))) < gamma + 1:
                tails = {s + (y,): c * laws(s)[0][y] for s, c in tails.items() for y in range(vocab) if laws(s)[0][y] > 0}
            for s, c in tails.items():
                out[s] = out.get(s, 0.0) + chance * pr * c
    return out, tokens


@pytest.mark.parametrize("seed", range(6))
def test_both_rules_give_exactly_the_targets_law_and_block_at_least_the_tokens(seed):
    """Exact, by enumeration of every draft of γ = 3 over 4 tokens with laws that depend on
    the whole prefix: the first γ + 1 tokens out of one round (and the target after it) have
    the target's joint law to rounding, under both rules; and the block rule yields at least
    the token rule's expected tokens a round (Sun et al. 2025, theorem 2)."""
    laws, gamma = ContextLaws(4, seed), 3
    truth = {}
    for s in itertools.product(range(4), repeat=gamma + 1):
        c = 1.0
        for i, y in enumerate(s):
            c *= laws(s[:i])[0][y]
        truth[s] = c
    tokens = {}
    for rule in sampling.RULES:
        law, tokens[rule] = _exact_output_law(laws, gamma, rule)
        assert max(abs(law.get(s, 0.0) - c) for s, c in truth.items()) < 1e-12, rule
        assert abs(sum(law.values()) - 1.0) < 1e-12
    assert tokens["block"] >= tokens["token"] - 1e-12


class LookupLaws(ContextLaws):
    """A prompt lookup's draft: no model draws it, each token a function of the prefix
    (here of its sum), so its law is the point mass the wire carries for it
    (specdec.encoding.point_masses), decoded as the target decodes it; the target's laws as in
    ContextLaws, zeros included (a looked-up token the target never emits)."""

    def __call__(self, prefix: tuple) -> tuple[list[float], list[float]]:
        if prefix not in self.laws:
            guess = (3 * sum(prefix) + len(prefix)) % self.vocab
            q = wire.decode(encoding.point_masses([guess], self.vocab), 1)[0].tolist()
            self.laws[prefix] = (self._draw(True), q)
        return self.laws[prefix]


@pytest.mark.parametrize("seed", range(6))
def test_a_looked_up_draft_verified_as_point_masses_gives_exactly_the_targets_law(seed):
    """Exact, by enumeration as above: a sampled session's looked-up draft, verified with
    point masses as its law, yields the target's joint law of the first γ + 1 tokens under
    both rules, the chances of its prefixes being kept are p's products, and the block
    rule keeps at least the token rule's tokens."""
    laws, gamma = LookupLaws(4, seed), 3
    truth = {}
    for s in itertools.product(range(4), repeat=gamma + 1):
        truth[s] = math.prod(laws(s[:i])[0][y] for i, y in enumerate(s))
    tokens = {}
    for rule in sampling.RULES:
        law, tokens[rule] = _exact_output_law(laws, gamma, rule)
        assert max(abs(law.get(s, 0.0) - c) for s, c in truth.items()) < 1e-12, rule
    assert tokens["block"] >= tokens["token"] - 1e-12
    draft = next(d for d in itertools.product(range(4), repeat=gamma)
                 if math.prod(laws(d[:i])[1][x] for i, x in enumerate(d)) == 1.0)  # the looked-up one
    p_x = [laws(draft[:i])[0][x] for i, x in enumerate(draft)]
    assert sampling.token_keep_chances_row(p_x, [1.0] * gamma) == pytest.approx(
        [math.prod(p_x[:i + 1]) for i in range(gamma)], abs=1e-15)


@pytest.mark.parametrize("seed", range(4))
def test_keep_chances_are_unbiased_for_the_kept_length_of_every_shorter_draft(seed):
    """Exact, by enumeration (γ = 3 over 4 tokens): over the draft's law, the mean keep
    chance at position i (the block weights w_i; the token rule's Π min(1, p/q)) is the
    chance that the rule keeps at least i tokens — what the γ policy learns from each round
    for every prefix length at once. Under the token rule it holds given each draft too."""
    laws, gamma = ContextLaws(4, seed), 3
    for rule in sampling.RULES:
        at_least, mean_chance = [0.0] * (gamma + 1), [0.0] * (gamma + 1)
        for draft in itertools.product(range(4), repeat=gamma):
            chance = math.prod(laws(draft[:i])[1][x] for i, x in enumerate(draft))
            if chance == 0:
                continue
            p_x = [laws(draft[:i])[0][x] for i, x in enumerate(draft)]
            q_x = [laws(draft[:i])[1][x] for i, x in enumerate(draft)]
            chances = (sampling.block_weights_row(p_x, q_x)[1:] if rule == "block"
                       else sampling.token_keep_chances_row(p_x, q_x))
            kept = [0.0] * (gamma + 1)
            for pr, produced in _round_law(laws, draft, rule):
                kept[len(produced) - 1] += pr
            for i in range(1, gamma + 1):
                at_least[i] += chance * sum(kept[i:])
                mean_chance[i] += chance * chances[i - 1]
                if rule == "token":
                    assert abs(sum(kept[i:]) - chances[i - 1]) < 1e-12
        assert max(abs(a - b) for a, b in zip(at_least, mean_chance)) < 1e-12, (rule, at_least, mean_chance)


def test_the_rules_coincide_for_one_draft_token_and_block_keeps_more_for_longer_drafts():
    gen = torch.Generator().manual_seed(11)
    B = 4000
    for gamma in (1, 4):
        p = torch.softmax(torch.randn(B, gamma + 1, V, generator=gen, dtype=torch.float64), -1)
        q = torch.softmax(torch.randn(B, gamma, V, generator=gen, dtype=torch.float64), -1)
        draft = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, gamma)
        u_acc = torch.rand(B, gamma, generator=gen, dtype=torch.float64)
        u_res = torch.rand(B, gamma + 1, generator=gen, dtype=torch.float64)
        block, token = (verify(draft, q, p, u_acc, u_res, rule=r) for r in ("block", "token"))
        if gamma == 1:
            assert torch.equal(block.accepted, token.accepted) and torch.equal(block.next_token, token.next_token)
        else:
            assert float(block.accepted.double().mean()) > float(token.accepted.double().mean())
    with pytest.raises(ValueError, match="rule"):
        verify(draft, q, p, u_acc, u_res, rule="blocky")


def test_the_plain_python_block_verdict_is_the_tensor_rule_exactly():
    """The target engine decides a batch with block_weights_row / block_prefix_row (a
    verdict reads γ numbers); they must give the tensor reference's prefixes exactly."""
    gen = torch.Generator().manual_seed(12)
    B, G = 3000, 5
    p_x = torch.rand(B, G, generator=gen, dtype=torch.float64)
    q_x = torch.rand(B, G, generator=gen, dtype=torch.float64) * 0.8 + 0.01
    eta = torch.rand(B, G, generator=gen, dtype=torch.float64)
    mass = torch.rand(B, G + 1, generator=gen, dtype=torch.float64) * 0.5
    gammas = torch.randint(0, G + 1, (B,), generator=gen)
    p_x[::7], q_x[::7] = 0.3, 0.3  # weights stuck at 1
    mass[::11] = 0.0  # no residual mass: a prefix never stops there
    w = sampling.block_weights(p_x, q_x)
    reference = sampling.block_accepted(w, mass, eta, gammas).tolist()
    for b in range(B):
        g = int(gammas[b])
        row_w = sampling.block_weights_row(p_x[b, :g].tolist(), q_x[b, :g].tolist())
        assert row_w == w[b, : g + 1].tolist()
        assert sampling.block_prefix_row(row_w, mass[b, 1:g].tolist(), eta[b, :g].tolist()) == reference[b], b
    assert len(set(reference)) == G + 1  # every prefix length occurred


def test_acceptance_rate_matches_sum_of_min():
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(V, generator=gen), -1).double()
    q = torch.softmax(torch.randn(V, generator=gen), -1).double()
    trials = 50000
    draft = sample_from(q.expand(trials, 1, V), torch.rand(trials, 1, generator=gen, dtype=torch.float64))
    res = verify(draft, q.expand(trials, 1, V), p.expand(trials, 2, V),
                 torch.rand(trials, 1, generator=gen, dtype=torch.float64), torch.rand(trials, 2, generator=gen, dtype=torch.float64))
    alpha = float(torch.minimum(p, q).sum())
    measured = float(res.accepted.double().mean())
    assert abs(measured - alpha) < 4 * (alpha * (1 - alpha) / trials) ** 0.5 + 1e-9


def test_draft_token_is_the_argmax_when_greedy_and_the_draft_streams_draw_otherwise():
    probs = torch.tensor([0.1, 0.5, 0.0, 0.4])
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=3)
    assert sampling.draft_token(logits_to_probs(probs.log(), greedy), greedy, 17) == 1
    t1 = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3)
    for position in range(50):
        u = torch.tensor(sampling.uniform(3, position, sampling.STREAM_DRAFT))
        assert sampling.draft_token(probs, t1, position) == int(sample_from(probs, u))
    assert {sampling.draft_token(probs, t1, pos) for pos in range(200)} == {0, 1, 3}  # never the zero


def test_verify_greedy_equals_verify_with_a_one_hot_target():
    """Any draft law q, any uniforms: with a greedy (one-hot) target the full rule and the
    argmax shortcut give the same accepted length and next token."""
    gen = torch.Generator().manual_seed(7)
    B, G, V = 64, 5, 12
    for _ in range(20):
        q = torch.rand(B, G, V, generator=gen, dtype=torch.float64) ** 4
        q /= q.sum(-1, keepdim=True)
        argmax = torch.randint(0, V, (B, G + 1), generator=gen)
        p = torch.zeros(B, G + 1, V, dtype=torch.float64).scatter_(-1, argmax[..., None], 1.0)
        # draft tokens: often the argmax, otherwise any token (zero-mass draws excluded)
        draft = torch.where(torch.rand(B, G, generator=gen) < 0.7, argmax[:, :G], torch.multinomial(
            q.view(-1, V), 1, generator=gen).view(B, G))
        gammas = torch.randint(0, G + 1, (B,), generator=gen)
        u_acc = torch.rand(B, G, generator=gen, dtype=torch.float64)
        u_res = torch.rand(B, G + 1, generator=gen, dtype=torch.float64)
        full = verify(draft, q, p, u_acc, u_res, gammas)
        short = verify_greedy(draft, argmax, gammas)
        assert torch.equal(full.accepted, short.accepted)
        assert torch.equal(full.next_token, short.next_token)
        # the packed plain-Python form the target engine uses: each session's γ_b + 1 rows
        drafts = [draft[b, : gammas[b]].tolist() for b in range(B)]
        packed = [t for b in range(B) for t in argmax[b, : gammas[b] + 1].tolist()]
        assert sampling.greedy_verdicts(drafts, packed) == list(zip(short.accepted.tolist(), short.next_token.tolist()))


def test_a_batch_of_draft_rows_equals_each_row_on_its_own():
    """The draft samples a whole batch's step at once (probs_rows, draft_tokens_rows); every
    row must be bit for bit what the one-session functions give it, whatever the mix of
    laws in the batch, at the draft's real vocabulary size."""
    from specdec.wire import quantize

    g = torch.Generator().manual_seed(3)
    vocab = 4096
    laws = [SamplingParams(0.0, 0, 1.0, 0), SamplingParams(1.0, 0, 1.0, 11), SamplingParams(0.7, 40, 1.0, 12),
            SamplingParams(1.3, 0, 0.9, 13), SamplingParams(1.0, 0, 1.0, 14), SamplingParams(0.0, 5, 0.5, 0)]
    for batch in (laws, laws[1:2] * 3, laws[:1] * 4):
        logits = torch.randn(len(batch), vocab, generator=g) * 4
        positions = [17 + 5 * b for b in range(len(batch))]
        q = quantize(sampling.probs_rows(logits, batch))
        tokens = sampling.draft_tokens_rows(q, batch, positions).tolist()
        for b, params in enumerate(batch):
            alone = quantize(logits_to_probs(logits[b], params))
            assert torch.equal(q[b], alone), (b, params)
            assert tokens[b] == sampling.draft_token(alone, params, positions[b]), (b, params)


def test_argmax_rows_is_torch_argmax_with_ties_and_strides():
    gen = torch.Generator().manual_seed(5)
    cases = [torch.randn(16, 4096, generator=gen), torch.randn(4096, generator=gen),
             torch.randn(3, 2, 50, generator=gen).double(), torch.randn(6, 300, generator=gen)[:, ::3],
             torch.randint(0, 3, (64, 9), generator=gen).float()]  # many ties: the first maximum wins
    for x in cases:
        with torch.inference_mode():
            assert torch.equal(sampling.argmax_rows(x), x.argmax(-1)), x.shape


def test_a_bonus_guess_under_the_targets_noise_agrees_far_more_often_than_an_independent_draw():
    """The draft's guess and the target's bonus share the bonus stream's noise:
    for close laws they agree far more often than Σ p·q, and the guess is a draw from q."""
    gen = torch.Generator().manual_seed(3)
    V, trials = 64, 4000
    p = torch.softmax(torch.randn(V, generator=gen) * 2.0, -1).double()
    q = torch.softmax(torch.log(p) + 0.3 * torch.randn(V, generator=gen, dtype=torch.float64), -1)
    params = [SamplingParams(1.0, seed=s) for s in range(trials)]
    positions = [17] * trials
    guesses = sampling.bonus_guess_rows(q.expand(trials, V), params, positions)
    bonus = sampling.race_argmax(p.expand(trials, V), sampling.bonus_noise(range(trials), positions, V))
    agree = (guesses == bonus).double().mean().item()
    tv = 0.5 * (p - q).abs().sum().item()
    assert agree > float((p * q).sum()) + 0.3
    assert agree > (1 - tv) / (1 + tv) - 0.05  # the Gumbel (race) coupling's known lower bound
    for draws, law in ((guesses, q), (bonus, p)):  # each side is still a draw from its own law
        freq = torch.bincount(draws, minlength=V).double() / trials
        assert 0.5 * (freq - law).abs().sum().item() < 0.08


def test_bonus_noise_is_standard_exponential_and_never_picks_zero_mass():
    g = sampling.bonus_noise([1, 2, 3], [10, 10, 11], 5000)
    assert g.shape == (3, 5000) and torch.isfinite(g).all() and bool((g > 0).all())
    assert abs(g.mean().item() - 1.0) < 0.05 and abs(g.var().item() - 1.0) < 0.1
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[1], g[2])
    assert torch.equal(g, sampling.bonus_noise([1, 2, 3], [10, 10, 11], 5000))  # counter-based
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7]] * 3)
    picks = sampling.race_argmax(probs.expand(3, 4), sampling.bonus_noise([1, 2, 3], [0, 0, 0], 4))
    assert set(picks.tolist()) <= {1, 3}


def test_draft_rows_with_guesses_draw_each_row_by_its_own_rule():
    gen = torch.Generator().manual_seed(11)
    V = 50
    q = torch.softmax(torch.randn(5, V, generator=gen) * 2, -1)
    q[4] = logits_to_probs(q[4], SamplingParams(0.0))  # a greedy row is one-hot, as probs_rows makes it
    params = [SamplingParams(1.0, seed=s) for s in range(4)] + [SamplingParams(0.0)]
    positions = [7, 8, 9, 10, 11]
    mixed = sampling.draft_tokens_rows(q, params, positions, guesses=[1, 4])
    plain = sampling.draft_tokens_rows(q, params, positions)
    guessed = sampling.bonus_guess_rows(q, params, positions)
    assert mixed.tolist() == [plain[0], guessed[1], plain[2], plain[3], guessed[4]]
    assert guessed[4] == plain[4] == q[4].argmax()  # a greedy row is its argmax either way


def test_top_probability_is_the_softmax_maximum():
    logits = torch.randn(3, 50) * 4
    assert torch.allclose(sampling.top_probability(logits), torch.softmax(logits, -1).amax(-1), atol=1e-6)
