"""The KV-cache runner against Hugging Face's own forward, on the bundled target."""
import torch

from specdec.model_runner import ForwardItem, ModelRunner


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
