"""specdec.native's sample_rows, residual_masses and rms_norm: the native draw picks exactly
the token that sampling's torch path picks for the same probabilities and uniform, including
the floating tie that lands on a trailing zero; the native residual masses are the torch
path's sums to the bit; the native final norm computes torch's; and the native top-p mask
and sampled law are the operators' to the bit."""
import math

import pytest
import torch
import torch.nn.functional as F

from specdec import native, sampling

TOP = 1.0 - 2.0 ** -53  # the largest uniform below 1


@pytest.fixture(scope="module")
def kernels():
    module = native.module()
    assert module is not None, native.unavailable_reason()
    return module


def _rows(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 4096, generator=gen) * torch.linspace(0.5, 12, 64)[:, None]
    probs = torch.softmax(logits, -1)
    probs[::3, ::2] = 0.0  # rows with holes, as top-k / top-p and residuals leave
    probs[5] = 0.0
    probs[5, 17] = 1.0  # one-hot
    probs[7, :4000] = 0.0  # mass only at the end
    probs[9, 100:] = 0.0  # mass only at the start: trailing zeros
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, TOP, 0.5, 1e-300], dtype=torch.float64)
    return probs.to(dtype), u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_draws_are_the_torch_draws(kernels, dtype):
    probs, u = _rows(dtype)
    want = sampling.sample_from_torch(probs, u)
    assert torch.equal(kernels.sample_rows(probs, u), want)
    assert torch.equal(sampling.sample_from(probs, u), want)  # the path sample_from takes once loaded
    for k in range(0, 4096, 512):  # uniforms across each row's whole range
        uk = torch.full((64,), k / 4096, dtype=torch.float64)
        assert torch.equal(kernels.sample_rows(probs, uk), sampling.sample_from_torch(probs, uk))


def test_a_tie_at_the_top_steps_back_to_the_last_token_with_mass(kernels):
    probs = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    u = torch.tensor([TOP], dtype=torch.float64)  # u · 3 rounds to 3: no running sum exceeds it
    assert sampling.sample_from_torch(probs, u).tolist() == [2]
    assert kernels.sample_rows(probs, u).tolist() == [2]
    nothing = torch.zeros(1, 5, dtype=torch.float64)  # no mass at all: token 0, as torch's path
    assert kernels.sample_rows(nothing, u).tolist() == sampling.sample_from_torch(nothing, u).tolist() == [0]


def test_sample_from_keeps_its_shapes_on_the_native_path(kernels):
    q = torch.softmax(torch.randn(4096, generator=torch.Generator().manual_seed(1)), -1)
    assert sampling.draft_token(q, sampling.SamplingParams(seed=3), 40) == \
        int(sampling.sample_from_torch(q, torch.tensor(sampling.uniform(3, 40, sampling.STREAM_DRAFT))))
    grid = torch.softmax(torch.randn(2, 3, 50), -1)
    for u in (torch.rand(2, 3, dtype=torch.float64), torch.rand(2, 3)):  # float32 uniforms widen alike
        assert torch.equal(kernels.sample_rows(grid, u), sampling.sample_from_torch(grid, u))
        assert torch.equal(sampling.sample_from(grid, u), sampling.sample_from_torch(grid, u))
    strided = torch.softmax(torch.randn(50, 6), 0).t()  # not contiguous
    u = torch.rand(6, dtype=torch.float64)
    assert torch.equal(kernels.sample_rows(strided, u), sampling.sample_from_torch(strided, u))


def test_sample_rows_rejects_what_it_cannot_draw_from(kernels):
    with pytest.raises(RuntimeError, match="float32 or float64"):
        kernels.sample_rows(torch.ones(2, 4, dtype=torch.float16), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="shape of probs' rows"):
        kernels.sample_rows(torch.ones(2, 4), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="empty vocabulary"):
        kernels.sample_rows(torch.ones(2, 0), torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("vocab", [4096, 4099, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_residual_masses_are_the_torch_sums_to_the_bit(kernels, monkeypatch, vocab, dtype):
    """The block rule's stop tests read these masses, so the native verdicts equal the
    operators' only if the sums round alike: both add in sampling.lane_sums' order, which a
    plain Python loop spells out here (lanes of whole and partial width)."""
    gen = torch.Generator().manual_seed(vocab)
    p = torch.softmax(torch.randn(12, vocab, generator=gen) * 4, -1).to(dtype)
    q = torch.softmax(torch.randn(12, vocab, generator=gen, dtype=torch.float64) * 4, -1)
    q[::4] = p[::4].double()  # p == q: no residual mass
    w = torch.rand(12, generator=gen, dtype=torch.float64)
    w[1] = 1.0
    native_masses = kernels.residual_masses(w, p, q)
    with monkeypatch.context() as patch:
        patch.setattr(native, "loaded", lambda: None)
        torch_masses = sampling.residual_mass(w, p, q)
    assert torch.equal(native_masses, torch_masses)
    assert torch.equal(sampling.residual_mass(w, p, q), native_masses)  # the path taken once loaded
    for r in range(12):
        lanes = [0.0] * sampling.MASS_LANES
        for v, (pv, qv) in enumerate(zip(p[r].double().tolist(), q[r].tolist())):
            lanes[v % sampling.MASS_LANES] += max(pv * w[r].item() - qv, 0.0)
        total = 0.0
        for lane in lanes:
            total += lane
        assert native_masses[r].item() == total, r
    assert native_masses[::4].eq(0).all() and native_masses.gt(0).sum() >= 6


def test_native_rms_norm_is_torchs(kernels, isa):
    gen = torch.Generator().manual_seed(8)
    for rows, hidden in ((1, 256), (5, 256), (3, 100)):
        x, w = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
        assert torch.allclose(kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (hidden,), w, 1e-6), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="hidden size"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


def _nucleus_rows() -> torch.Tensor:
    """Rows from peaked to flat, with holes, ties across the boundary and a one-hot."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(40, 4096, generator=gen) * torch.linspace(0.2, 20, 40)[:, None]
    probs = torch.softmax(logits, -1)
    probs[::4, ::3] = 0.0
    probs[1, :300] = probs[1, 300]  # 300 tied tokens, the nucleus' boundary among them
    probs[2] = 0.0
    probs[2, 5] = 1.0
    probs[3, 10:20] = 0.1  # ten tokens of 0.1 each and nothing else
    probs[3, :10] = 0.0
    probs[3, 20:] = 0.0
    probs[4] = 1 / 4096  # all tied: every cut falls among ties
    return probs


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.5, 0.9, 0.95, 0.999, 1 - 1e-7, 1 - 1e-9])
def test_the_native_nucleus_is_the_sorted_ones(kernels, top_p):
    """specdec.native's top_p_drop (no full sort) drops exactly what the stable sort's
    cumulative sums drop, row by row, ties taken by the lower id, at cuts from one token to
    all of them; and sampling.top_p_drop takes it once loaded."""
    probs = _nucleus_rows()
    want = sampling.top_p_drop_torch(probs, top_p)
    assert torch.equal(kernels.top_p_drop(probs, top_p), want)
    assert torch.equal(sampling.top_p_drop(probs, top_p), want)
    assert torch.equal(kernels.top_p_drop(probs[7], top_p), want[7])  # one row, 1-D
    assert (~want).sum(-1).min() >= 1  # every row keeps a token
    kept = int((~want[4]).sum())  # the uniform row keeps its lowest ids
    assert kept == min(4096, math.ceil(top_p * 4096)) and not want[4, :kept].any()


def test_the_nucleus_is_the_smallest_set_of_the_likeliest_tokens_reaching_top_p():
    """The reference itself, against its definition on small rows: keep tokens in order of
    probability, ties by id, until the mass kept reaches top_p (exact fractions here)."""
    probs = torch.tensor([[0.25, 0.125, 0.25, 0.375, 0.0], [0.5, 0.0, 0.25, 0.25, 0.0]])
    kept = lambda top_p: (~sampling.top_p_drop_torch(probs, top_p)).nonzero().tolist()
    assert kept(0.375) == [[0, 3], [1, 0]]
    assert kept(0.5) == [[0, 0], [0, 3], [1, 0]]  # the tie at 0.25: the lower id first
    assert kept(0.625) == [[0, 0], [0, 3], [1, 0], [1, 2]]
    assert kept(0.9) == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 2], [1, 3]]


def _law_logits(trial: int, vocab: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(trial)
    x = torch.randn(rows, vocab, generator=gen) * (0.5 + 6 * torch.rand(1, generator=gen))
    if trial % 5 == 0:
        x = x.round()  # ties: at the kth value, at the nucleus' edge, at min-p's threshold
    if trial % 7 == 0:
        x[:, 1::3] = float("-inf")  # banned tokens (min_tokens, a bias of −∞), never all
    return x


def test_the_native_law_is_the_operators_to_the_bit(kernels):
    """specdec.native's law_rows = logits_to_probs_torch's operators, every bit, over 480
    mixtures of temperature, top-k, top-p and min-p on rows of 1 to 4,096 tokens with ties
    and banned tokens; and logits_to_probs takes it once loaded."""
    for trial in range(480):
        vocab = (4096, 50, 7, 1)[trial % 4]
        x = _law_logits(trial, vocab, 1 + trial % 6)
        params = sampling.SamplingParams(
            temperature=(1.0, 0.7, 1.3, 0.05)[trial % 4], top_k=(0, 1, 5, 50, vocab)[trial % 5],
            top_p=(1.0, 0.9, 0.5, 0.999)[trial % 4] if trial % 3 else 1.0, min_p=(0.0, 0.05, 0.3)[trial % 3])
        want = sampling.logits_to_probs_torch(x, params)
        got = kernels.law_rows(x, params.temperature, params.top_k, params.top_p, params.min_p)
        assert torch.equal(got, want), (trial, params)
        assert torch.equal(sampling.logits_to_probs(x, params), want)
    one = _law_logits(3, 4096, 1)[0]  # a 1-D row keeps its shape
    assert torch.equal(kernels.law_rows(one, 0.8, 40, 0.9, 0.1), sampling.logits_to_probs_torch(
        one, sampling.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.1)))


def test_the_native_law_refuses_what_is_not_a_law(kernels):
    x = torch.randn(2, 16)
    for args, says in [((x.double(), 1.0, 0, 1.0, 0.0), "float32"), ((x, 0.0, 0, 1.0, 0.0), "temperature"),
                       ((x, 1.0, 0, 0.0, 0.0), "top_p"), ((x, 1.0, 0, 1.0, 1.5), "min_p"),
                       ((torch.empty(2, 0), 1.0, 0, 1.0, 0.0), "empty")]:
        with pytest.raises(RuntimeError, match=says):
            kernels.law_rows(*args)
