"""specdec.native's packed attention against torch's SDPA: each session's rows attend
causally to its own cache, grouped-query heads share their kv head, the new keys and
values land in the cache, and bad arguments are refused."""
import pytest
import torch
import torch.nn.functional as F

from specdec import native
from specdec.model_runner import ForwardItem, ModelRunner
from tests.specdec.test_model_runner import reference_logits


@pytest.fixture(scope="module")
def kernels():
    module = native.module()
    assert module is not None, native.unavailable_reason()
    return module


def _reference(qkv, heads, kv_heads, caches, starts, lengths, layer, scale):
    """The same attention by SDPA, session by session, on copies of the caches."""
    outs, offset, D = [], 0, qkv.shape[2]
    caches = [c.clone() for c in caches]
    for cache, start, n in zip(caches, starts, lengths):
        rows = qkv[offset : offset + n]
        cache[layer, :, start : start + n] = rows[:, heads:].transpose(0, 1)
        keys, values = cache[layer, :kv_heads, : start + n], cache[layer, kv_heads:, : start + n]
        mask = torch.arange(start + n)[None] <= torch.arange(start, start + n)[:, None]
        out = F.scaled_dot_product_attention(rows[:, :heads].transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, scale=scale, enable_gqa=kv_heads != heads)[0]
        outs.append(out.transpose(0, 1).reshape(n, heads * D))
        offset += n
    return torch.cat(outs), caches


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 64), (6, 3, 40), (2, 1, 128)])
def test_each_sessions_rows_attend_to_its_own_cache(kernels, isa, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * dim)
    starts, lengths, layers = [0, 37, 5, 300], [7, 1, 5, 3], 3
    caches = [torch.randn(layers, 2 * kv_heads, 320, dim, generator=gen) for _ in starts]
    qkv = torch.randn(sum(lengths), heads + 2 * kv_heads, dim, generator=gen)
    expected, expected_caches = _reference(qkv, heads, kv_heads, caches, starts, lengths, 1, dim**-0.5)
    out = kernels.packed_attention(qkv, heads, kv_heads, caches, starts, lengths, 1, dim**-0.5)
    assert out.shape == (sum(lengths), heads * dim)
    assert torch.allclose(out, expected, atol=2e-6, rtol=1e-5)
    for got, want, start, n in zip(caches, expected_caches, starts, lengths):
        assert torch.equal(got[1, :, : start + n], want[1, :, : start + n])  # the new keys and values, written
        assert torch.equal(got[[0, 2]], want[[0, 2]])  # the other layers untouched


def test_saturated_scores_give_sdpas_softmax(kernels, isa):
    """Scores hundreds apart: exp(s − max) underflows to exactly 0 and nothing overflows."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(4, 3, 32, generator=gen) * 12
    cache = torch.randn(1, 2, 64, 32, generator=gen) * 12
    expected, _ = _reference(qkv, 1, 1, [cache], [50], [4], 0, 1.0)
    out = kernels.packed_attention(qkv, 1, 1, [cache], [50], [4], 0, 1.0)
    assert torch.isfinite(out).all() and torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert (out == 0).sum() == (expected == 0).sum()  # the one-hot rows stay exactly one-hot


@pytest.mark.parametrize("bad,match", [
    (dict(lengths=[2, 1]), "lengths add up to"),
    (dict(starts=[7, 0]), "past its cache's capacity"),
    (dict(layer=4), "is not a contiguous float32"),
    (dict(heads=3), "head slots"),
])
def test_bad_arguments_are_refused(kernels, bad, match):
    args = dict(qkv=torch.randn(4, 6, 8), heads=2, kv_heads=2, caches=[torch.zeros(2, 4, 8, 8), torch.zeros(2, 4, 8, 8)],
                starts=[0, 0], lengths=[3, 1], layer=1, scale=1.0)
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        kernels.packed_attention(*args.values())


def test_a_runner_on_native_attention_computes_the_models_logits(target_model):
    native_runner = ModelRunner(target_model, attention="native")
    assert native_runner.attention == "native" and ModelRunner(target_model, attention="sdpa").attention == "sdpa"
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, 4096, (40,), generator=gen), torch.randint(0, 4096, (12,), generator=gen)
    ca, cb = native_runner.new_cache(), native_runner.new_cache()
    first = native_runner.forward([ForwardItem(ca, a[:35], 35), ForwardItem(cb, b[:11], 2)])
    rest = native_runner.forward([ForwardItem(ca, a[35:], 5), ForwardItem(cb, b[11:], 1)])
    assert torch.allclose(first[0], reference_logits(target_model, a[:35]), atol=1e-4)
    assert torch.allclose(rest[0], reference_logits(target_model, a)[-5:], atol=1e-4)
    assert torch.allclose(rest[1], reference_logits(target_model, b)[-1:], atol=1e-4)
    with pytest.raises(ValueError, match="auto, native, sdpa or paged"):
        ModelRunner(target_model, attention="flash")
