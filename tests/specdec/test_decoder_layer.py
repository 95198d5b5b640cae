"""specdec.native's fused decoder layer: a runner whose layers run as one native call each
computes what its layer-by-layer path and Hugging Face's forward compute, on every
instruction set the CPU has, and only plain Llama layers over native kernels are fused."""
import copy

import pytest
import torch

from specdec import native
from specdec.model_runner import ForwardItem, ModelRunner
from tests.specdec.test_model_runner import reference_logits


def _feed(runner, caches, chunks):
    return runner.forward([ForwardItem(c, t, len(t)) for c, t in zip(caches, chunks)])


def test_fused_layers_compute_the_unfused_layers_and_the_models_logits(target_model, isa):
    fused, plain = ModelRunner(target_model, linear_kernels="half"), ModelRunner(target_model, linear_kernels="half",
                                                                                   fuse_layers=False)
    assert fused.fused and not plain.fused
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 4096, (n,), generator=gen) for n in (33, 70, 4)]
    cf, cp = [fused.new_cache() for _ in prompts], [plain.new_cache() for _ in prompts]
    steps = [prompts] + [[torch.randint(0, 4096, (n,), generator=gen) for _ in prompts] for n in (1, 5, 1)]
    history = [p.clone() for p in prompts]
    for chunks in steps:
        out_f, out_p = _feed(fused, cf, chunks), _feed(plain, cp, chunks)
        for a, b in zip(out_f, out_p):
            assert torch.allclose(a, b, atol=5e-5)
        if chunks is not prompts:
            history = [torch.cat([h, c]) for h, c in zip(history, chunks)]
    for out, h in zip(out_f, history):  # the last step against Hugging Face's full forward
        assert torch.allclose(out, reference_logits(target_model, h)[-1:], atol=1e-4)
    for a, b in zip(cf, cp):  # both wrote the same keys and values
        assert a.length == b.length and torch.allclose(a.kv[:, :, : a.length], b.kv[:, :, : b.length], atol=1e-5)


def test_only_plain_layers_over_native_kernels_are_fused(target_model, draft_model):
    assert ModelRunner(target_model).fused == (native.module() is not None)
    assert not ModelRunner(target_model, linear_kernels="aten").fused
    assert not ModelRunner(target_model, attention="sdpa").fused
    assert not ModelRunner(target_model, fuse_layers=False).fused
    biased = copy.deepcopy(draft_model)
    biased.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(256))
    assert not ModelRunner(biased).fused  # a bias: layer by layer, still on the native kernels
    runner = ModelRunner(biased)
    ids = torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(runner.forward([ForwardItem(runner.new_cache(), ids, 12)])[0],
                          reference_logits(biased, ids), atol=1e-4)


def test_a_whole_forward_in_one_call_is_the_fused_layers_bit_for_bit(draft_model, target_model, isa):
    """specdec.native's PackedModel (embedding, layers, final norm and head in one call) runs
    the very kernels the per-layer path runs, in the same order: the same bits."""
    for model, quantize in ((target_model, "none"), (draft_model, "int8")):
        whole = ModelRunner(copy.deepcopy(model), linear_kernels="half", quantize=quantize)
        layered = ModelRunner(copy.deepcopy(model), linear_kernels="half", quantize=quantize, whole_forward=False)
        assert whole.whole and whole.fused and not layered.whole and layered.fused
        gen = torch.Generator().manual_seed(5)
        cw, cl = [whole.new_cache() for _ in range(3)], [layered.new_cache() for _ in range(3)]
        for lengths, rows in (((33, 70, 4), (1, 70, 2)), ((1, 5, 1), (1, 5, 1)), ((3, 1, 2), (2, 1, 1))):
            chunks = [torch.randint(0, 4096, (n,), generator=gen) for n in lengths]
            out_w = whole.forward([ForwardItem(c, t, r) for c, t, r in zip(cw, chunks, rows)])
            out_l = layered.forward([ForwardItem(c, t, r) for c, t, r in zip(cl, chunks, rows)])
            assert [o.shape[0] for o in out_w] == list(rows)
            assert all(torch.equal(a, b) for a, b in zip(out_w, out_l)), (quantize, lengths)
        assert all(a.length == b.length and torch.equal(a.kv[:, :, : a.length], b.kv[:, :, : b.length])
                   for a, b in zip(cw, cl))


def test_a_whole_forward_checks_its_arguments(draft_model):
    runner = ModelRunner(copy.deepcopy(draft_model), linear_kernels="half")
    cache = runner.new_cache()
    cache.reserve(8)
    whole = runner._whole
    with pytest.raises(RuntimeError, match="3 ids for 4 tokens"):
        whole.forward(torch.tensor([1, 2, 3]), [cache.kv], [0], [4], [1])
    with pytest.raises(RuntimeError, match="wants logits for 1 .. its tokens"):
        whole.forward(torch.tensor([1, 2]), [cache.kv], [0], [2], [3])
    with pytest.raises(RuntimeError, match="exceed the rotary table"):
        whole.forward(torch.tensor([1]), [cache.kv], [runner.max_length], [1], [1])
    with pytest.raises(RuntimeError, match="ids must be 1-D int64"):
        whole.forward(torch.tensor([1.0]), [cache.kv], [0], [1], [1])
