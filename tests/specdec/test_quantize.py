"""Int8 draft weights (specdec.quantize): the factors, their packing, the native int8
products on every instruction set, a runner serving exactly the quantised model, and
speculation with an int8 draft still the target's law (greedy: token for token). The same
for "w8a8", whose compact kernel also rounds its input rows to int8 and multiplies by 8-bit
dot products (specdec/native/int8_dot.cpp)."""
import copy

import pytest
import torch

from draft_service.engine import DraftEngine
from specdec import half_weights, native, quantize
from specdec.model_runner import ForwardItem, ModelRunner
from specdec.sampling import SamplingParams
from specdec.spec_loop import generate
from target_service.engine import TargetEngine
from tests.specdec.test_model_runner import reference_logits

CPU = torch.device("cpu")
needs_vnni = pytest.mark.skipif(native.module() is None or not native.module().has_int8_dot(),
                                reason="this CPU has no 8-bit dot products (AVX-512 VNNI)")


def test_rows_quantise_to_int8_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, 77, generator=gen) * torch.logspace(-3, 2, 50)[:, None]
    w[7] = 0.0  # a row of zeros
    q, scale = quantize.quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (50,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127  # symmetric: -128 never used
    assert float(scale[7]) == 1.0 and not q[7].any()
    err = (quantize.dequantize(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())  # each value within half a step of its row


def test_the_packed_panels_carry_values_then_their_scales():
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize.quantize_rows(torch.randn(70, 9, generator=gen))
    packed = half_weights.pack_int8(q, scale, 16)
    assert packed.shape == (5, 9 + 4, 16) and packed.dtype == torch.int8
    assert torch.equal(packed[0, :9, :].t(), q[:16]) and torch.equal(packed[4, :9, :6].t(), q[64:])
    assert not packed[4, :9, 6:].any()  # padded columns: value 0
    tail = packed[:, 9:, :].contiguous().view(torch.float32).view(-1)  # [panels × 16] scales
    assert torch.equal(tail[:70], scale) and bool((tail[70:] == 1.0).all())


@pytest.mark.parametrize("out,inner", [(4096, 256), (300, 96), (70, 33)])
def test_int8_products_match_the_dequantised_weight_at_every_row_count(isa, out, inner):
    gen = torch.Generator().manual_seed(out)
    weight = torch.randn(out, inner, generator=gen)
    bias = torch.randn(out, generator=gen)
    q, scale = quantize.quantize_rows(weight)
    packed = half_weights.pack_int8(q, scale, native.module().panel_width())
    exact = quantize.dequantize(q, scale).double()
    for rows in (1, 2, 5, 6, 7, 13):
        x = torch.randn(rows, inner, generator=gen)
        y = native.module().half_linear(x, packed, out, bias)
        ref = x.double() @ exact.t() + bias.double()
        assert y.shape == (rows, out)
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4), (isa, rows)


def test_int8_panels_are_checked():
    q, scale = quantize.quantize_rows(torch.randn(32, 8))
    packed = half_weights.pack_int8(q, scale, native.module().panel_width())
    with pytest.raises(RuntimeError, match="x has 9 columns"):
        native.module().half_linear(torch.randn(2, 9), packed, 32, None)
    with pytest.raises(RuntimeError, match="float16, bfloat16 or int8"):
        native.module().half_linear(torch.randn(2, 8), packed.to(torch.int16), 32, None)


def test_dot_panels_carry_values_in_fours_then_column_sums_then_scales():
    gen = torch.Generator().manual_seed(3)
    q, scale = quantize.quantize_rows(torch.randn(70, 9, generator=gen))  # 9 inputs: padded to 12
    packed = half_weights.pack_int8_dot(q, scale)
    assert packed.shape == (2, 12 + 8, 64) and packed.dtype == torch.uint8
    values = packed[:, :12, :].contiguous().view(torch.int8).view(2, 3, 64, 4)  # [panel, group, column, input]
    padded = torch.zeros(128, 12, dtype=torch.int8)
    padded[:70, :9] = q
    assert torch.equal(values.permute(0, 2, 1, 3).reshape(128, 12), padded)
    csum = packed[:, 12:16, :].contiguous().view(torch.int32).view(-1)
    assert torch.equal(csum, padded.sum(dim=1, dtype=torch.int32) * 128)
    tail = packed[:, 16:, :].contiguous().view(torch.float32).view(-1)
    assert torch.equal(tail[:70], scale) and bool((tail[70:] == 1.0).all())


@pytest.mark.parametrize("out,inner", [(4096, 256), (300, 96), (70, 33)])
def test_dot_products_are_the_rounded_rows_times_the_weights_to_the_bit(isa, out, inner):
    """Integer sums are exact, so the kernel's output is one float rounding of them, on every
    instruction set (VNNI where this CPU has it and AVX-512 is in use, else the plain loop)."""
    gen = torch.Generator().manual_seed(inner)
    q, scale = quantize.quantize_rows(torch.randn(out, inner, generator=gen))
    bias = torch.randn(out, generator=gen)
    packed = half_weights.pack_int8_dot(q, scale)
    for rows in (1, 2, 5, 6, 7, 13):
        x = torch.randn(rows, inner, generator=gen) * torch.logspace(-2, 1, rows)[:, None]
        x[0] = 0.0  # a row of zeros: scale 1, output the bias
        amax = x.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        ints = (torch.round(x / s).double() @ q.double().t()).float()  # exact below 2^24
        expected = ints * (s * scale[None, :]) + bias
        got = native.module().half_linear(x, packed, out, bias)
        assert torch.equal(got, expected), (isa, rows)
        assert torch.equal(native.module().int8_dot_linear(x, packed, out, bias), got)
        emulated = quantize.quantize_activations(x).double() @ quantize.dequantize(q, scale).double().t() + bias
        assert torch.allclose(got.double(), emulated, rtol=1e-5, atol=1e-4)


def test_dot_panels_are_checked():
    q, scale = quantize.quantize_rows(torch.randn(32, 8))
    packed = half_weights.pack_int8_dot(q, scale)
    with pytest.raises(RuntimeError, match="x has 13 columns, the weight 8"):
        native.module().half_linear(torch.randn(2, 13), packed, 32, None)
    with pytest.raises(RuntimeError, match="65 columns do not fit 1 panels"):
        native.module().half_linear(torch.randn(2, 8), packed, 65, None)
    with pytest.raises(RuntimeError, match="must be packed uint8"):
        native.module().int8_dot_linear(torch.randn(2, 8), packed.view(torch.int8), 32, None)


@pytest.mark.parametrize("kernels", ["auto", "aten", "half"])
def test_an_int8_runner_serves_exactly_the_quantised_model(draft_model, kernels):
    reference = copy.deepcopy(draft_model)
    quantize.quantize_linears_(reference)
    runner = ModelRunner(copy.deepcopy(draft_model), linear_kernels=kernels, quantize="int8")
    assert runner.kernels_summary.endswith("; weights int8")
    assert runner.fused == (kernels != "aten")  # the fused layers run the int8 panels too
    ids = torch.randint(0, runner.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    cache = runner.new_cache()
    got = torch.cat([runner.forward([ForwardItem(cache, ids[:37], 37)])[0],
                     runner.forward([ForwardItem(cache, ids[37:], 3)])[0]])
    ref = reference_logits(reference, ids)
    assert torch.allclose(got, ref, atol=1e-4)
    unquantised = reference_logits(draft_model, ids)
    assert not torch.allclose(got, unquantised, atol=1e-3)  # it is another model, if a close one
    assert float((got - unquantised).abs().max()) < 0.5


@needs_vnni
def test_a_w8a8_runner_serves_int8_weights_with_rounded_rows_in_its_compact_kernel(draft_model):
    runner = ModelRunner(copy.deepcopy(draft_model), linear_kernels="half", quantize="w8a8")
    assert runner.kernels_summary.endswith("; weights w8a8") and runner.fused
    assert runner.head.half.dtype == torch.uint8  # the dot-product layout
    ids = torch.randint(0, runner.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    cache = runner.new_cache()
    got = torch.cat([runner.forward([ForwardItem(cache, ids[:37], 37)])[0],
                     runner.forward([ForwardItem(cache, ids[37:], 3)])[0]])
    weights_only = copy.deepcopy(draft_model)
    quantize.quantize_linears_(weights_only)
    emulated = reference_logits(quantize.round_linear_inputs_(copy.deepcopy(weights_only)), ids)
    # float rounding apart from the emulation, which now and then moves one input across a
    # rounding step (a few hundredths of a logit, there and at the positions after it)
    per_row = (got - emulated).abs().amax(dim=1)
    assert float(per_row.median()) < 1e-4 and float(per_row.max()) < 0.2
    int8_only = reference_logits(weights_only, ids)
    assert float((got - int8_only).abs().amax(dim=1).median()) > 100 * float(per_row.median())


def test_w8a8_is_refused_where_its_products_cannot_run(draft_model):
    with pytest.raises(ValueError, match="w8a8 cannot serve this model: it serves float32 models on a CPU"):
        ModelRunner(copy.deepcopy(draft_model).to(torch.bfloat16), quantize="w8a8")
    if native.module().best_isa() == "avx512":
        before = native.module().set_isa("avx2")
        try:
            assert not native.module().has_int8_dot()
            with pytest.raises(ValueError, match="no 8-bit dot products"):
                ModelRunner(copy.deepcopy(draft_model), quantize="w8a8")
        finally:
            native.module().set_isa(before)


def test_quantising_a_model_twice_is_done_once(draft_model):
    model = copy.deepcopy(draft_model)
    first = quantize.quantize_linears_(model)
    weights = [p.clone() for p in model.parameters()]
    assert quantize.quantize_linears_(model) is first
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    tied = model.get_output_embeddings().weight
    assert torch.equal(model.get_input_embeddings().weight, tied)  # the tied embedding followed its head


def test_auto_quantises_a_float32_model_on_a_cpu_only():
    best = "w8a8" if native.module().has_int8_dot() else "int8"
    assert quantize.resolve("auto", CPU, torch.float32) == best
    assert quantize.resolve("auto", CPU, torch.bfloat16) == "none"
    assert quantize.resolve("auto", torch.device("cuda"), torch.bfloat16) == "none"
    assert quantize.resolve("none", CPU, torch.float32) == "none"
    assert quantize.resolve("int8", CPU, torch.bfloat16) == "int8"  # asked for: the aten products then
    # on a GPU int8 weights would save nothing (no kernel streams them there) and keep their copies
    with pytest.raises(ValueError, match="int8 weights are a CPU's option .* on cuda"):
        quantize.resolve("int8", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="quantize must be one of auto, none, int8, w8a8"):
        quantize.resolve("int4", CPU, torch.float32)
    with pytest.raises(ValueError, match="quantize must be one of none, int8, w8a8"):
        ModelRunner(torch.nn.Module(), quantize="auto")


@pytest.mark.parametrize("mode", ["int8", pytest.param("w8a8", marks=needs_vnni)])
def test_a_quantised_draft_leaves_greedy_output_token_identical_to_the_target(draft_model, target_model, tokenizer,
                                                                              heldout_prompts, mode):
    """Losslessness does not depend on the draft: any proposals, checked by the target."""
    draft = DraftEngine(ModelRunner(copy.deepcopy(draft_model), quantize=mode), 1024)
    target_engine = TargetEngine(ModelRunner(target_model), 1024)
    drafted = 0
    for prompt in heldout_prompts[:3]:
        ids = tokenizer(prompt)["input_ids"]
        expected = target_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48,
                                         pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        got = generate(draft, target_engine, ids, SamplingParams(temperature=0.0), 4, 48, eos_id=tokenizer.eos_token_id)
        assert got.tokens == expected[:len(got.tokens)] and len(got.tokens) == len(expected)
        drafted += got.stats.drafted
    assert drafted > 0
