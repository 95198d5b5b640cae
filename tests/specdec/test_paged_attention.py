"""Attention over paged caches for a whole batch (specdec.paged_attention) against Hugging
Face's forward: sessions of other lengths and starts, prefills among verifications, forks,
grouped-query heads, and the GPU's layout (query heads folded) run here."""
import pytest
import torch

from specdec.model_runner import ForwardItem, ModelRunner
from specdec.paged_attention import PADDING, groups_of
from tests.specdec.test_model_runner import reference_logits, tiny_model


def test_groups_hold_every_session_once_and_bound_their_padding():
    starts = [5, 900, 40, 41, 300, 7, 2000, 120]
    lengths = [5, 5, 1, 300, 5, 9, 5, 2]
    groups = groups_of(starts, lengths, 64)
    assert sorted(b for g in groups for b in g) == list(range(8))
    assert [3] in groups  # a prefill alone
    for g in groups:
        ends = [starts[b] + lengths[b] for b in g]
        assert len(g) == 1 or len(g) * max(ends) <= PADDING * sum(ends)
    assert len(groups_of([100] * 16, [5] * 16, 64)) == 1  # like sessions: one call


@pytest.mark.parametrize("model_name,gpu_layout", [("target", False), ("target", True), ("qwen2", False),
                                                   ("qwen2", True)])
def test_a_paged_batch_matches_hugging_face(model_name, gpu_layout, target_model, tmp_path):
    """Rounds of a batch whose sessions start at other positions and feed 1–9 tokens (a
    prompt's prefill of more than a band among them), each rolled back by a rejection, and
    a fork taken midway: every session's logits are Hugging Face's over its whole text."""
    model = target_model if model_name == "target" else tiny_model(model_name, tmp_path)
    runner = ModelRunner(model, attention="paged")
    runner.device_layout = gpu_layout
    assert runner.attention == "paged" and runner.pool is not None
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (3, 70, 17, 1)]
    caches, texts = [runner.new_cache() for _ in prompts], [[] for _ in prompts]
    for step in range(6):
        if step == 3:  # a fork of the second session's first 40 positions, fed on its own from there
            caches.append(caches[1].fork(40, 60))
            texts.append(texts[1][:40])
        feeds = prompts if step == 0 else [torch.randint(0, runner.vocab_size, (1 + (step + i) % 9,),
                                                         generator=gen).tolist() for i in range(len(caches))]
        out = runner.forward([ForwardItem(c, torch.tensor(f), len(f)) for c, f in zip(caches, feeds)])
        for i, (c, f) in enumerate(zip(caches, feeds)):
            ref = reference_logits(model, torch.tensor(texts[i] + f))[-len(f):]
            assert torch.allclose(out[i], ref, atol=1e-4), (step, i)
            keep = len(f) - (step > 0 and len(f) > 1 and (step + i) % 2)  # a rejected last token now and then
            texts[i] += f[:keep]
            c.truncate(len(texts[i]))
    del c
    caches.clear()
    assert runner.pool.used == 0
