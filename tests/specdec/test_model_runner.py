"""The KV-cache runner against Hugging Face's own forward, on the bundled target."""
import pytest
import torch

from specdec.model_runner import ForwardItem, ModelRunner, aligned_mask, grouped_attention


def reference_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()


def test_prefill_and_extend_match_a_full_forward(target_model):
    runner = ModelRunner(target_model)
    ids = torch.randint(0, runner.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(target_model, ids)
    cache = runner.new_cache()
    first = runner.forward([ForwardItem(cache, ids[:40], 40)])[0]
    rest = runner.forward([ForwardItem(cache, ids[40:], 8)])[0]
    assert torch.allclose(first, ref[:40], atol=1e-4)
    assert torch.allclose(rest, ref[40:], atol=1e-4)
    assert cache.length == 48


def test_truncate_then_extend_equals_fresh_prefill(target_model):
    runner = ModelRunner(target_model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, runner.vocab_size, (40,), generator=gen)
    rejected = torch.randint(0, runner.vocab_size, (6,), generator=gen)
    cache = runner.new_cache()
    runner.forward([ForwardItem(cache, torch.cat([ids[:30], rejected]), 1)])
    cache.truncate(30)  # drop the rejected draft
    after = runner.forward([ForwardItem(cache, ids[30:], 10)])[0]
    fresh = runner.forward([ForwardItem(runner.new_cache(), ids, 10)])[0]
    assert torch.allclose(after, fresh, atol=1e-5)


def test_sessions_of_different_lengths_share_one_pass(target_model):
    runner = ModelRunner(target_model)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, runner.vocab_size, (25,), generator=gen)
    b = torch.randint(0, runner.vocab_size, (7,), generator=gen)
    out = runner.forward([ForwardItem(runner.new_cache(), a, 5), ForwardItem(runner.new_cache(), b, 7)])
    assert torch.allclose(out[0], reference_logits(target_model, a)[-5:], atol=1e-4)
    assert torch.allclose(out[1], reference_logits(target_model, b), atol=1e-4)


def test_cache_bytes_are_known_and_grow_with_length(target_model):
    runner = ModelRunner(target_model)
    cache = runner.new_cache()
    small = cache.nbytes
    runner.forward([ForwardItem(cache, torch.zeros(600, dtype=torch.long), 1)])
    assert cache.nbytes > small
    assert cache.nbytes >= 600 * runner.bytes_per_token()


def test_causal_mask_table_matches_the_definition(target_model):
    runner = ModelRunner(target_model)
    L = runner.max_length
    for start, n in [(0, 2), (7, 5), (L - 64, 64), (100, runner.BAND), (3, runner.BAND + 9), (5, 1)]:
        mask = runner._mask(start, n)
        if n == 1:
            assert mask is None
            continue
        expected = torch.arange(start + n)[None] <= torch.arange(start, start + n)[:, None]
        assert mask.dtype == runner.dtype, (start, n)  # additive: SDPA adds it as it is
        assert torch.equal(mask == 0, expected), (start, n)
        assert torch.equal(mask[~expected], torch.full_like(mask[~expected], float("-inf"))), (start, n)


def tiny_model(family, path, **extra):
    """A tiny random model of `family` with grouped-query attention (4 heads, 2 kv heads),
    saved and loaded back like any checkpoint; `extra` are further config fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                                  **extra)
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases start at 0 and norms at 1: make them count
        for name, param in fresh.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    fresh.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_llama_family_models_match_hugging_face(family, tmp_path):
    """Biases (Qwen2), per-head q/k norms (Qwen3), grouped-query attention."""
    model = tiny_model(family, tmp_path)
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(3))
    ref = reference_logits(model, ids)
    runner = ModelRunner(model)
    cache = runner.new_cache()
    first = runner.forward([ForwardItem(cache, ids[:24], 24)])[0]
    rest = runner.forward([ForwardItem(cache, ids[24:], 6)])[0]
    assert torch.allclose(first, ref[:24], atol=1e-4)
    assert torch.allclose(rest, ref[24:], atol=1e-4)
    assert torch.allclose(reference_logits(model, ids), ref)  # the HF modules still work on the fused weights


@pytest.mark.parametrize("family,extra,served", [
    ("mistral", {"sliding_window": 32}, 32),
    ("qwen2", {"sliding_window": 32, "use_sliding_window": True}, 32),
    ("qwen2", {"sliding_window": 32, "use_sliding_window": False}, 256),
    ("mistral", {"sliding_window": 512}, 256),
])
def test_a_sliding_window_model_is_served_within_its_window(family, extra, served, tmp_path):
    """Within its window a sliding-window model's attention is full attention, which the
    runner computes: its context is the window, and there it matches Hugging Face."""
    model = tiny_model(family, tmp_path, **extra)
    runner = ModelRunner(model)
    assert runner.max_length == served
    ids = torch.randint(0, 512, (served,), generator=torch.Generator().manual_seed(4))
    cache = runner.new_cache()
    logits = runner.forward([ForwardItem(cache, ids, served)])[0]
    assert torch.allclose(logits, reference_logits(model, ids), atol=1e-4)


def test_an_aligned_mask_is_the_mask_repeated_in_an_aligned_buffer():
    band = torch.zeros(8, 300, dtype=torch.bfloat16)
    band.masked_fill_(torch.rand(8, 300, generator=torch.Generator().manual_seed(4)) < 0.3, float("-inf"))
    for start, n, groups in [(5, 3, 1), (0, 8, 2), (37, 5, 4), (211, 8, 3)]:
        mask = band[:n, start : start + 2 * n + 7]
        out = aligned_mask(mask, groups)
        assert out.shape == (groups * n, mask.shape[1])
        assert torch.equal(out, mask.repeat(groups, 1)), (start, n, groups)
        # what CUDA's memory-efficient attention checks: 16-byte start, rows 8 elements apart
        assert out.data_ptr() % 16 == 0 and out.stride(0) % 8 == 0 and out.stride(1) == 1
    assert band[:3, 5:20].data_ptr() % 16 != 0  # a slice of the table is not


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_folded_query_heads_attend_as_grouped_query_attention(kv_heads):
    """The GPU layout (each kv head's query heads folded into rows, the mask repeated) gives
    what SDPA's enable_gqa gives, with a causal mask over a cache and without one."""
    gen = torch.Generator().manual_seed(5)
    H, n, start, D = 4, 5, 11, 16
    q = torch.randn(H, n, D, generator=gen)
    keys, values = torch.randn(2, kv_heads, start + n, D, generator=gen)
    allowed = torch.arange(start + n)[None] <= torch.arange(start, start + n)[:, None]
    mask = torch.zeros(n, start + n).masked_fill_(~allowed, float("-inf"))
    expected = grouped_attention(q, keys, values, mask, 0.25)
    folded = grouped_attention(q, keys, values, aligned_mask(mask, H // kv_heads), 0.25, fold=True)
    assert torch.allclose(folded, expected, atol=1e-6)
    one = q[:, -1:].contiguous()
    assert torch.allclose(grouped_attention(one, keys, values, None, 0.25, fold=True),
                          grouped_attention(one, keys, values, None, 0.25), atol=1e-6)


@pytest.mark.parametrize("model_name", ["target", "qwen2"])
def test_the_gpu_attention_layout_matches_hugging_face_here(model_name, target_model, tmp_path):
    """The SDPA path as a GPU runs it (`device_layout`: query heads folded, masks aligned),
    run on this CPU: prompts and verifications fed at every start modulo 8, the bundled
    target (no grouped heads) and a grouped-query model, against Hugging Face's forward."""
    model = target_model if model_name == "target" else tiny_model(model_name, tmp_path)
    runner = ModelRunner(model, attention="sdpa", fuse_layers=False)
    runner.device_layout = True
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, runner.vocab_size, (60,), generator=gen)
    ref = reference_logits(model, ids)
    cache, start = runner.new_cache(), 0
    for n in (9, 1, 5, 3, 5, 6, 2, 5, 7, 5, 4, 8):  # starts 9, 10, 15, 18, 23, 29, 31, 36, 43, 48, 52
        out = runner.forward([ForwardItem(cache, ids[start : start + n], n)])[0]
        assert torch.allclose(out, ref[start : start + n], atol=1e-4), (start, n)
        start += n
    assert start == 60


def test_a_batch_invariant_runner_gives_a_session_the_same_bits_in_any_company(target_model):
    """With the compact products at every row count and native attention (this CPU's
    default once the kernels built), a session's logits do not depend on its forward's
    other rows: the same bits alone, beside other sessions of other lengths, and with its
    prompt fed whole, in chunks or token by token. So a seeded request reproduces whatever
    its batch company and after a failover's re-prefill."""
    runner = ModelRunner(target_model)
    if not runner.batch_invariant:
        pytest.skip(f"this runner is not batch-invariant here: {runner.kernels_summary}")
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, runner.vocab_size, (90,), generator=gen)
    draft = torch.randint(0, runner.vocab_size, (5,), generator=gen)

    def verify(splits, company):
        cache, i = runner.new_cache(), 0
        for n in splits:
            runner.forward([ForwardItem(cache, prompt[i : i + n], 1)])
            i += n
        others = []
        for length in company:
            other = runner.new_cache()
            runner.forward([ForwardItem(other, torch.randint(0, runner.vocab_size, (length,), generator=gen), 1)])
            others.append(ForwardItem(other, torch.randint(0, runner.vocab_size, (1 + length % 5,), generator=gen),
                                      1 + length % 5))
        return runner.forward([ForwardItem(cache, draft, 5)] + others)[0]

    alone = verify([90], [])
    for splits, company in [([90], [12]), ([90], [30, 7, 66, 3] * 4), ([64, 26], [5, 9]), ([1] * 90, []),
                            ([37, 1, 52], [120])]:
        assert torch.equal(verify(splits, company), alone), (splits, company)
