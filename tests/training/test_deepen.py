"""Deepening the target: the deeper model starts with exactly the trained one's function,
and every trained layer keeps its place, each followed by its copies."""
import pytest
import torch
from transformers import LlamaForCausalLM

from training.deepen import deepen, layer_sources


def test_layer_sources_spread_the_copies_evenly():
    assert layer_sources(2, 4) == [(0, False), (0, True), (1, False), (1, True)]
    assert layer_sources(3, 5) == [(0, False), (0, True), (1, False), (1, True), (2, False)]
    assert layer_sources(2, 2) == [(0, False), (1, False)]
    with pytest.raises(ValueError):
        layer_sources(4, 3)


def test_deepened_target_computes_the_same_logits(bundled_paths):
    target = LlamaForCausalLM.from_pretrained(bundled_paths[1], dtype=torch.float32).eval()
    have = target.config.num_hidden_layers
    ids = torch.randint(0, target.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = target(input_ids=ids).logits
        deep = deepen(target, have + 3).eval()
        after = deep(input_ids=ids).logits
    assert deep.config.num_hidden_layers == len(deep.model.layers) == have + 3
    assert torch.allclose(before, after, atol=1e-5)
    assert deep.lm_head.weight.data_ptr() == deep.model.embed_tokens.weight.data_ptr()  # still tied
    copy = deep.model.layers[1]  # layer 0's copy: its inputs are trained, its outputs start at zero
    assert torch.equal(copy.self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight)
    assert copy.mlp.down_proj.weight.abs().sum() == 0
    assert torch.equal(deep.model.layers[2].mlp.down_proj.weight, target.model.layers[1].mlp.down_proj.weight)
