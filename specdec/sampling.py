"""The sampling core of speculative decoding: pure tensor functions, no model, no I/O.

Words (Leviathan et al. 2023, Chen et al. 2023):
- *draft tokens* x_1..x_γ are sampled from the draft's distributions q_1..q_γ;
- the target scores them in one pass, giving p_1..p_{γ+1};
- x_i is *accepted* with probability min(1, p_i(x_i) / q_i(x_i)), left to right;
- at the first rejection i the *recovered* token is drawn from norm(max(0, p_i − q_i));
- when all γ are accepted the *bonus* token is drawn from p_{γ+1}.
The tokens so produced are distributed exactly as the target's own samples. Greedy
decoding (temperature 0) is the special case where p and q are one-hot: a draft token
is accepted iff it is the target's argmax, and the recovered token is that argmax.

That is the *token* rule. The default is the *block* rule (Sun et al., "Block Verification
Accelerates Speculative Decoding", ICLR 2025), which decides the whole draft jointly and
keeps the same exact output law while accepting at least as much in expectation: a weight
w_0 = 1, w_i = min(1, w_{i−1} p_i(x_i) / q_i(x_i)) carries the ratio forward, so a draft
token the target likes more than the draft did makes up for an earlier one it liked less;
the kept prefix is the longest i whose stop test passes (`block_accepted`), and the next
token comes from norm(max(0, w_i p_{i+1} − q_{i+1})). With γ = 1 the two rules coincide.
tests/specdec/test_sampling.py checks the law of both by exact enumeration and by sampling.

Every function is vectorised over the batch of sessions and the γ positions; the
randomness comes in as explicit uniforms (see `uniforms`), so results depend only on
(seed, position) and never on batching, device or which replica runs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specdec import native
from specdec.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1  # seeds are hashed as unsigned 64-bit integers
STREAM_BONUS, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESAMPLE = 0, 1, 2, 3
MASS_LANES = 16  # residual masses are summed in this many interleaved lanes (lane_sums)
VECTOR_FROM = 16  # uniforms_at hashes this many or more at once in numpy
RULES = ("block", "token")  # how sampled drafts are verified; greedy is the same under both


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int) -> float:
    """A counter-based uniform in [0, 1) for (seed, token position, stream).

    Stateless on purpose: any replica or orchestrator that continues a session draws the
    same numbers, so a seeded request is reproducible across failover and batching. Each
    position's number in a stream is consumed at most once by the output, which keeps the
    draws independent of everything already committed.
    """
    h = _splitmix64((seed & MASK64) ^ _splitmix64(position * 4 + stream))
    return (h >> 11) * (1.0 / (1 << 53))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` over a uint64 array (numpy's uint64 arithmetic wraps modulo 2^64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms_at(seeds: Sequence[int], positions: Sequence[int], stream: int) -> torch.Tensor:
    """[n] float64 uniforms, the i-th exactly `uniform(seeds[i], positions[i], stream)`.

    A batch's verification needs a few per session, for sessions with different seeds and
    positions: one vectorised hash instead of a Python call each. numpy's fixed cost
    (about 21 µs here) beats the Python calls (about 1.6 µs each) only from 16 numbers on,
    so fewer, as a lone session's draft step or verdict needs, take the scalar hash."""
    positions = list(positions)
    if len(positions) < VECTOR_FROM:
        return torch.tensor([uniform(s, p, stream) for s, p in zip(seeds, positions)], dtype=torch.float64)
    seed = np.array([s & MASK64 for s in seeds], dtype=np.uint64)
    counter = np.asarray(positions, dtype=np.uint64) * np.uint64(4) + np.uint64(stream)
    h = _splitmix64_array(seed ^ _splitmix64_array(counter))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)))


_TOKEN_KEYS: dict[int, np.ndarray] = {}


def bonus_noise(seeds: Sequence[int], positions: Sequence[int], vocab: int) -> torch.Tensor:
    """[n, vocab] float64 standard exponential noise, one per (seed, position, token), from
    the bonus stream: what a bonus token after a fully accepted draft is drawn with
    (`race_argmax`), and what the draft's guess of that bonus is drawn with
    (`bonus_guess_rows`). Counter-based like `uniform`, so any replica draws the same."""
    keys = _TOKEN_KEYS.get(vocab)
    if keys is None:
        keys = _TOKEN_KEYS[vocab] = _splitmix64_array(np.arange(vocab, dtype=np.uint64))
    rows = np.array([_splitmix64((s & MASK64) ^ _splitmix64(p * 4 + STREAM_BONUS))
                     for s, p in zip(seeds, positions)], dtype=np.uint64)
    h = _splitmix64_array(rows[:, None] ^ keys[None, :])
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
    return torch.from_numpy(-np.log(u))


def race_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[B, V] probabilities (need not sum to 1) and [B, V] exponential noise E → [B] tokens:
    argmax of p / E, an exact draw from norm(p) (the exponential race: the first of
    independent clocks with rates p(x) to ring; with G = −log E it is the Gumbel-max trick,
    argmax log p + G, for one logarithm instead of three). Zero-mass tokens score 0 and are
    never drawn."""
    return argmax_rows(probs.double() / noise.to(probs.device))


def bonus_guess_rows(q: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> torch.Tensor:
    """[B] guesses of the target's bonus tokens at positions[b], row b drawn from the
    draft's q[b] ([B, V]) by `race_argmax` with the noise the target's bonus at that
    position is drawn with. Two close laws under the same noise pick the same token
    far more often than two independent draws: measured on the bundled pair at
    temperature 1 (teacher-forced on target samples of 8 held-out prompts), 0.67 against
    Σ p·q = 0.20 (1 − TV, the most any coupling reaches, is 0.72; inverse-CDF sampling
    with one shared uniform, 0.35). The guess only decides whether a pre-drafted round is
    used, never which tokens are output: the tokens after it are drafted with the draft
    stream's uniforms, exactly as the next round would draft them on the same prefix.
    Greedy rows are one-hot, whose argmax any noise keeps."""
    if all(p.greedy for p in params):
        return argmax_rows(q)
    return race_argmax(q, bonus_noise([p.seed for p in params], positions, q.shape[-1]))


def uniforms(seed: int, start: int, count: int, stream: int) -> torch.Tensor:
    """[count] float64 uniforms for positions start .. start+count-1."""
    return uniforms_at([seed] * count, range(start, start + count), stream)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., V] → [...] int64: each row's first maximum, exactly `x.argmax(-1)`. On the CPU
    numpy's vectorised argmax does it (torch's there is scalar code: [80, 4096] float32 rows
    590 µs against 24 µs, a single row 9.4 against 2.1 µs, on the 2-core CPU); both return
    the first index of the maximum. Elsewhere torch's."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.shape[-1] > 0:
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1)))
    return x.argmax(-1)


def runner_up_rows(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[B, V] logits and [B] chosen tokens → [B] int64: each row's largest other token.
    Where a greedy target rejects the draft's argmax it corrects to the draft's runner-up
    about a third of the time on the bundled pair (teacher-forced on held-out windows),
    which makes that token the best guess of the branch a rejected round takes."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    masked = logits.clone()
    masked[rows, chosen.to(logits.device)] = float("-inf")
    return argmax_rows(masked).cpu()


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] logits → [B] float32: each row's largest probability at temperature 1,
    exp(max − logsumexp), without building the distribution. The draft's confidence for
    the stop rule (ProposeRequest.stop_below), the same for greedy and sampled sessions."""
    logits = logits.float()
    return torch.exp(logits.amax(-1) - torch.logsumexp(logits, -1))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits → [..., V] float32 probabilities under temperature, top-k, top-p,
    min-p, in that order (as transformers' and vLLM's samplers apply them).

    Greedy gives a one-hot of the argmax, so one acceptance rule serves both modes. A
    sampled law is one call of specdec.native's law_rows on a CPU where the kernels are
    loaded (the same bits as `logits_to_probs_torch`, for a fraction of its operators' cost),
    else those operators.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax_rows(logits).unsqueeze(-1), 1.0)
    kernels = native.loaded()
    if kernels is not None and logits.is_cpu:
        return kernels.law_rows(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return logits_to_probs_torch(logits, params)


def logits_to_probs_torch(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logits_to_probs` of a sampled law by torch's operators: any device, and the native
    law's reference."""
    logits = logits.float()
    if params.temperature != 1.0:  # x / 1 is x: skip an operator over the whole vocabulary
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(top_p_drop(probs, params.top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0.0:  # a ratio to the row's largest: the same before or after renormalising
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] probabilities → the [..., V] mask of the tokens top-p truncation drops: all
    but the smallest set of the likeliest tokens (ties: the lower id first) whose mass reaches
    top_p. One call of specdec.native's top_p_drop on a CPU where the kernels are loaded
    (the same mask, without sorting the vocabulary); else `top_p_drop_torch`."""
    kernels = native.loaded()
    if kernels is not None and probs.is_cpu and probs.dtype == torch.float32:
        return kernels.top_p_drop(probs, top_p)
    return top_p_drop_torch(probs, top_p)


def top_p_drop_torch(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_drop` by a full sort: any device, and the native mask's reference. The sort is
    stable so that tied tokens at the boundary are taken in id order on every device (torch's
    default sort leaves their order to the algorithm)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
    drop_sorted = mass_before >= top_p  # keeps the smallest set reaching top_p
    return torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)


def law_key(params: SamplingParams) -> tuple:
    """What `logits_to_probs` depends on: rows with the same law share its operators."""
    return ("greedy",) if params.greedy else (params.temperature, params.top_k, params.top_p, params.min_p)


def probs_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[B, V] logits with one SamplingParams per row → [B, V] float32 probabilities, each
    row exactly `logits_to_probs(row, its params)`.

    The draft calls this once per step for every session in the batch: rows that share a
    law go through `logits_to_probs` together (every operator there works row by row),
    so a batch costs one set of operators per law rather than one per session.
    """
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(law_key(p), []).append(i)
    if len(groups) == 1:
        return logits_to_probs(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        out[index] = logits_to_probs(logits[index], params[rows[0]])
    return out


def draft_tokens_rows(q: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                      guesses: Sequence[int] = ()) -> torch.Tensor:
    """[B] draft tokens, row b drawn from q[b] ([B, V]) with its session's draft-stream
    uniform at positions[b]: each equals `draft_token(q[b], params[b], positions[b])`.
    The rows listed in `guesses` are guesses of the target's bonus instead
    (`bonus_guess_rows`); each row is drawn once, by one rule or the other.
    Greedy rows are one-hot, and inverse-CDF sampling of a one-hot returns its token for
    any u in [0, 1), so one draw serves a mixed batch; an all-greedy batch is one argmax."""
    if all(p.greedy for p in params):
        return argmax_rows(q)
    if not guesses:
        u = uniforms_at([p.seed for p in params], positions, STREAM_DRAFT).to(q.device)
        return sample_from(q, u)
    out = torch.empty(len(params), dtype=torch.long)
    taken = set(guesses)
    plain = [r for r in range(len(params)) if r not in taken]
    for rows, draw in ((list(guesses), bonus_guess_rows), (plain, draft_tokens_rows)):
        if rows:
            index = torch.tensor(rows, device=q.device)
            out[rows] = draw(q[index], [params[r] for r in rows], [positions[r] for r in rows]).cpu()
    return out


_NATIVE_DRAWS = (torch.float32, torch.float64)  # the probabilities specdec.native's sample_rows takes


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [..., V] probabilities (need not sum to 1) and [...] uniforms
    → [...] token ids. Deterministic given u; never returns a zero-probability token.
    On a CPU where a model runner has loaded specdec.native, one call of its sample_rows
    draws the same tokens (tests/specdec/test_native_sampling.py)."""
    kernels = native.loaded()
    if (kernels is not None and probs.is_cpu and u.is_cpu and probs.dtype in _NATIVE_DRAWS
            and probs.shape[-1] > 0 and u.shape == probs.shape[:-1]):
        return kernels.sample_rows(probs, u)
    return sample_from_torch(probs, u)


def sample_from_torch(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample_from` in torch's operators: any device, and the reference the native draw is
    tested against."""
    cdf = probs.double().cumsum(-1)
    target = u.to(cdf.dtype) * cdf[..., -1]
    idx = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    idx = idx.clamp_(max=probs.shape[-1] - 1)
    # Floating ties at the top of the CDF could land on a trailing zero: step back to the
    # last token with mass (rare; a gather, not a loop over the vocabulary).
    bad = probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    if bool(bad.any()):
        last_nonzero = (probs > 0).cumsum(-1).argmax(-1)
        idx = torch.where(bad, last_nonzero, idx)
    return idx


def draft_token(q: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The draft's token at `position`, drawn from its [V] distribution q with the draft
    stream's uniform for that position. Greedy q is a one-hot, whose token is its argmax:
    no draw needed."""
    if params.greedy:
        return int(q.argmax())
    return int(sample_from(q, torch.tensor(uniform(params.seed, position, STREAM_DRAFT))))


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [B] int64, number of draft tokens accepted
    next_token: torch.Tensor  # [B] int64, recovered or bonus token


def accepted_lengths(p_x: torch.Tensor, q_x: torch.Tensor, u_accept: torch.Tensor,
                     gammas: torch.Tensor) -> torch.Tensor:
    """The acceptance half of `verify`: [B, γ] target and draft probabilities of the draft
    tokens and their uniforms, [B] per-session γ_b (padding beyond it is ignored) →
    [B] lengths of the accepted prefixes. x_i is accepted w.p. min(1, p(x_i) / q(x_i))."""
    G = p_x.shape[1]
    ok = u_accept.to(p_x.device, torch.float64) * q_x.double() < p_x.double()
    ok &= torch.arange(G, device=p_x.device) < gammas.unsqueeze(1)
    return ok.long().cumprod(-1).sum(-1)


def block_weights(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """The block rule's weights: [B, γ] target and draft probabilities of the draft tokens
    → [B, γ + 1] float64, w_0 = 1 and w_i = min(1, w_{i−1} p(x_i) / q(x_i)). Padding
    (q = 0) gives 0. A loop over the γ positions, each step over the whole batch."""
    ratio = torch.where(q_x > 0, p_x.double() / q_x.double().clamp(min=1e-300), 0.0)
    w = torch.ones(ratio.shape[0], ratio.shape[1] + 1, dtype=torch.float64, device=ratio.device)
    for i in range(ratio.shape[1]):
        w[:, i + 1] = torch.clamp(w[:, i] * ratio[:, i], max=1.0)
    return w


def residual_mass(w: torch.Tensor, p_rows: torch.Tensor, q_rows: torch.Tensor) -> torch.Tensor:
    """[R] weights and [R, V] rows of p and q → [R] Σ_x max(0, w p(x) − q(x)): the mass of
    the block rule's residual after a prefix whose weight is w. Summed in one fixed order
    (`lane_sums`), which specdec.native's kernels keep too: on a CPU where a model runner
    has loaded them, one call of its residual_masses gives the same numbers, and its
    block_verdicts decides every stop test alike to the last bit."""
    kernels = native.loaded()
    if kernels is not None and p_rows.is_cpu and q_rows.is_cpu and p_rows.dtype in _NATIVE_DRAWS:
        return kernels.residual_masses(w, p_rows, q_rows)
    out = p_rows.double() if p_rows.dtype != torch.float64 else p_rows.clone()
    out = out.mul_(w[:, None].to(out.device)).sub_(q_rows.to(out.device, torch.float64)).clamp_(min=0.0)
    return lane_sums(out)


def lane_sums(x: torch.Tensor) -> torch.Tensor:
    """[R, V] float64 → [R] row sums in a fixed order: lane k adds the entries v ≡ k (mod
    MASS_LANES) in order, then the lanes are added in order (a CPU's float64 cumsum adds
    in order). A whole row in one chain of adds costs a native kernel the latency of
    every add; a vectorised sum rounds in an order no other code can repeat. Zeros pad the
    row to whole lanes: adding +0 changes no sum."""
    rows, vocab = x.shape
    if rows == 0 or vocab == 0:
        return x.new_zeros(rows)
    pad = -vocab % MASS_LANES
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(rows, (vocab + pad) // MASS_LANES, MASS_LANES).cumsum(1)[:, -1].cumsum(-1)[:, -1]


def stop_probabilities(w: torch.Tensor, mass: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """The block rule's stop tests: [B, γ + 1] weights (`block_weights`), [B, γ + 1] residual
    masses (column i: `residual_mass` after i tokens; columns 0 and γ_b unread) and [B] γ_b
    → [B, γ] h, column i − 1 for prefix i: h_i = m_i / (m_i + 1 − w_i) for 1 ≤ i < γ_b (0
    where both vanish: no residual to draw from), h_γ_b = w_γ_b, 0 beyond γ_b."""
    G = w.shape[1] - 1
    wi, mi = w[:, 1:].double(), mass[:, 1:].double().to(w.device)
    denominator = mi + 1.0 - wi
    h = torch.where(denominator > 0, mi / denominator.clamp(min=1e-300), 0.0)
    prefix = torch.arange(1, G + 1, device=w.device)[None]
    gammas = gammas.to(w.device)[:, None]
    h = torch.where(prefix == gammas, wi, h)
    return torch.where(prefix <= gammas, h, 0.0)


def block_accepted(w: torch.Tensor, mass: torch.Tensor, eta: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """The acceptance half of the block rule: weights, residual masses and γ_b as
    `stop_probabilities` takes them, and [B, γ] uniforms (column i − 1 for prefix i) →
    [B] lengths of the kept prefixes: the longest prefix i whose test η_i < h_i passes, or
    none. Not the first failure, as in the token rule: a later pass overrides it."""
    G = eta.shape[1]
    if G == 0:
        return torch.zeros(w.shape[0], dtype=torch.long, device=w.device)
    ok = eta.to(w.device, torch.float64) < stop_probabilities(w, mass, gammas)
    return (ok.long() * torch.arange(1, G + 1, device=w.device)[None]).amax(-1)


def block_weights_row(p_x: Sequence[float], q_x: Sequence[float]) -> list[float]:
    """`block_weights` of one session in plain Python floats (the same operations in the
    same order, so the same numbers): a verdict reads γ of them, where a tensor operator
    costs more than the arithmetic (`greedy_verdicts` has the same reason)."""
    w = [1.0]
    for p, q in zip(p_x, q_x):
        w.append(min(w[-1] * (p / q if q > 0 else 0.0), 1.0))
    return w


def token_keep_chances_row(p_x: Sequence[float], q_x: Sequence[float]) -> list[float]:
    """The token rule's chance, given the draft, that its prefix of i = 1..γ tokens is kept:
    Π_{j ≤ i} min(1, p(x_j) / q(x_j)). The block rule's weights (`block_weights_row`,
    w_1..w_γ) play the same part: over the draft's law, E[w_i] is exactly the chance that
    block verification keeps at least i tokens (tests/specdec/test_sampling.py), although
    not given one draft. Either way a round tells, for every i ≤ γ, an unbiased figure of
    what drafting i tokens keeps, with less noise than the one kept length it yields —
    what the orchestrator's γ policy learns from (orchestrator/gamma_policy.py)."""
    out, chance = [], 1.0
    for p, q in zip(p_x, q_x):
        chance *= min(1.0, p / q) if q > 0 else 0.0
        out.append(chance)
    return out


def block_keeps_all(w: Sequence[float], eta: Sequence[float]) -> bool:
    """Whether the block rule keeps a session's whole draft of γ = len(eta) ≥ 1 tokens: the
    longest prefix is tested first and needs no residual mass."""
    return eta[-1] < w[len(eta)]


def block_prefix_row(w: Sequence[float], masses: Sequence[float], eta: Sequence[float]) -> int:
    """`block_accepted` of one session in plain Python: weights w_0..w_γ, residual masses
    after the inner prefixes 1..γ−1 (`residual_mass`; unread when the whole draft is kept)
    and uniforms η_1..η_γ → the kept prefix's length, longest first."""
    gamma = len(eta)
    if gamma == 0:
        return 0
    if block_keeps_all(w, eta):
        return gamma
    for i in range(gamma - 1, 0, -1):
        m = masses[i - 1]
        denominator = m + 1.0 - w[i]
        if eta[i - 1] < (m / denominator if denominator > 0 else 0.0):
            return i
    return 0


def next_tokens(p_n: torch.Tensor, q_n: torch.Tensor, u: torch.Tensor,
                w_n: torch.Tensor | None = None) -> torch.Tensor:
    """The recovery half of `verify`: at each session's stopping position, [B, V] target
    probabilities p_n and the draft's q_n there (a zero row where every draft token was
    accepted: the bonus has no q to subtract), [B] uniforms → [B] tokens drawn from
    norm(max(0, p − q)), which is p itself for the bonus. Under the block rule the kept
    prefix's weights w_n [B] scale p first: norm(max(0, w p − q))."""
    residual = (p_n if w_n is None else p_n * w_n[:, None].to(p_n.device, p_n.dtype)) - q_n
    residual = residual.clamp_(min=0.0)
    # p == q up to rounding leaves no residual mass: then p itself is the right law.
    empty = residual.sum(-1, keepdim=True) <= 0
    if bool(empty.any()):
        residual = torch.where(empty, p_n, residual)
    return sample_from(residual, u.to(p_n.device))


def verify(
    draft_tokens: torch.Tensor,  # [B, γ] int64
    q: torch.Tensor,  # [B, γ, V] draft probabilities (exactly what the draft sampled from)
    p: torch.Tensor,  # [B, γ+1, V] target probabilities
    u_accept: torch.Tensor,  # [B, γ] uniforms
    u_resample: torch.Tensor,  # [B, γ+1] uniforms, one per position the new token may take
    gammas: torch.Tensor | None = None,  # [B] per-session γ_b ≤ γ (padding beyond it)
    bonus_noise: torch.Tensor | None = None,  # [B, V] exponential noise for the bonus (`bonus_noise`)
    rule: str = "block",  # of RULES
) -> VerifyResult:
    """Speculative acceptance, recovery and bonus for a batch of sessions at once, on
    padded [B, γ(+1), V] tensors: the reference form. The target engine feeds the same
    halves (`accepted_lengths`, `next_tokens`, `race_argmax`) only the values they read,
    without padding. With `bonus_noise`, a session that accepted all of its γ_b ≥ 1 draft
    tokens draws its bonus from p by `race_argmax` instead of inverse-CDF (the same law;
    it lets the draft guess it: `bonus_guess_rows`). `rule`: "block" (the default) or
    "token" (the module's docstring)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    B, G = draft_tokens.shape
    assert q.shape[:2] == (B, G) and p.shape[:2] == (B, G + 1), (q.shape, p.shape)
    if gammas is None:
        gammas = torch.full((B,), G, dtype=torch.long, device=p.device)
    rows = torch.arange(B, device=p.device)
    if G > 0:
        accepted, w_n = _accept(draft_tokens, q, p, u_accept, gammas, rule)
    else:
        accepted, w_n = torch.zeros(B, dtype=torch.long, device=p.device), None
    p_n = p[rows, accepted]  # [B, V]
    if G > 0:
        rejected = (accepted < gammas).unsqueeze(-1)
        q_n = q[rows, accepted.clamp(max=G - 1)] * rejected  # bonus: no q to subtract
    else:
        q_n = torch.zeros_like(p_n)
    next_token = next_tokens(p_n, q_n, u_resample.to(p.device)[rows, accepted], w_n)
    if bonus_noise is not None and G > 0:
        full = (accepted >= gammas) & (gammas > 0)
        if bool(full.any()):
            next_token = torch.where(full, race_argmax(p_n, bonus_noise).to(p.device), next_token)
    return VerifyResult(accepted=accepted, next_token=next_token)


def _accept(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u_accept: torch.Tensor,
            gammas: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`verify`'s acceptance for γ ≥ 1: → (the accepted lengths n [B]; under the block rule
    the weight w_n of each session's kept prefix, which scales its residual, 1 where it kept
    all; None under the token rule)."""
    B, G = draft_tokens.shape
    p_x = p[:, :G].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, γ]
    q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, γ]
    if rule != "block":
        return accepted_lengths(p_x, q_x, u_accept, gammas), None
    w = block_weights(p_x, q_x)
    mass = torch.zeros(B, G + 1, dtype=torch.float64, device=p.device)
    if G > 1:  # after prefixes 1 .. γ − 1: the rows of the next positions
        mass[:, 1:G] = residual_mass(w[:, 1:G].reshape(-1), p[:, 1:G].reshape(B * (G - 1), -1),
                                     q[:, 1:G].reshape(B * (G - 1), -1)).view(B, G - 1)
    accepted = block_accepted(w, mass, u_accept, gammas)
    rows = torch.arange(B, device=p.device)
    return accepted, torch.where(accepted < gammas, w[rows, accepted], 1.0)  # the bonus is p's own draw


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                  gammas: torch.Tensor | None = None) -> VerifyResult:
    """`verify` for a greedy target, without building a distribution.

    When p is the one-hot of the target's argmax a_i, u·q(x) < p(x) holds iff x = a_i
    (q(x) ≤ 1 > u), and at the first mismatch the residual max(0, p − q) is the one-hot
    of a_i again; the bonus is a_{γ+1}. So the outcome depends on neither q nor the
    uniforms: accept the prefix that matches the argmax, then emit the argmax.
    draft_tokens [B, γ], target_argmax [B, γ+1], gammas [B] (default γ).
    """
    B, G = draft_tokens.shape
    if gammas is None:
        gammas = torch.full((B,), G, dtype=torch.long, device=draft_tokens.device)
    match = (draft_tokens == target_argmax[:, :G]) & (torch.arange(G, device=draft_tokens.device) < gammas[:, None])
    accepted = match.long().cumprod(-1).sum(-1)
    next_token = target_argmax.gather(-1, accepted[:, None]).squeeze(-1)
    return VerifyResult(accepted=accepted, next_token=next_token)


def greedy_verdicts(drafts: Sequence[Sequence[int]], argmax: Sequence[int]) -> list[tuple[int, int]]:
    """`verify_greedy` on packed rows, in plain Python: session b's draft tokens and the
    target's argmax at each of its γ_b + 1 rows, laid end to end in `argmax` →
    (accepted, next token) per session. A verdict reads at most γ + 1 integers per session,
    so a loop over them beats the eight tensor operators of padding and comparing (about
    0.1 ms at one session, 0.7 ms at 16 on the 2-core CPU); the tensor form stays the
    reference (tests/specdec/test_sampling.py checks they agree)."""
    out, row = [], 0
    for draft in drafts:
        n = 0
        while n < len(draft) and draft[n] == argmax[row + n]:
            n += 1
        out.append((n, argmax[row + n]))
        row += len(draft) + 1
    return out
