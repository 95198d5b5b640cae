"""The runner's CPU product kernels: each gives F.linear's numbers to float precision at any
row count, the table sends each row count to the kernel chosen for its range, and a runner
on any kernel computes the model's logits."""
import copy

import pytest
import torch
import torch.nn.functional as F

from specdec import half_weights, native
from specdec.linear_kernels import BOUNDS, KERNELS, PROBES, KernelTable, Product, calibrate, choose, prepare
from specdec.model_runner import ForwardItem, ModelRunner
from tests.specdec.test_model_runner import reference_logits

CPU = torch.device("cpu")


def test_every_row_count_falls_in_its_range():
    table = KernelTable([0, 0, 1, 1, 2, 2, 0, 1])
    assert [KERNELS[table.kernel(n)] for n in (1, 2, 3, 4, 5, 16, 17, 32, 33, 64, 65, 10_000)] == \
        ["aten", "aten", "onednn", "onednn", "onednn", "half", "half", "half", "aten", "aten", "onednn", "onednn"]
    assert table.describe() == "1-2: aten, 3-8: onednn, 9-32: half, 33-64: aten, 65+: onednn"
    assert KernelTable().describe() == "1+: aten" and table.used() == {"aten", "onednn", "half"}
    assert all(lo <= hi for lo, hi in zip(PROBES, BOUNDS))  # each range is timed at a row count inside it


def _products(dtype, out=300, inner=96, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inner, generator=gen).to(dtype).float()  # 16-bit values held in float32
    if dtype == torch.bfloat16:
        weight *= 2.0**20  # past float16's range, so that they are held as bfloat16
    b = torch.randn(out, generator=gen) if bias else None
    return weight, b


@pytest.mark.parametrize("kernel", ["onednn", "half"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out,inner", [(300, 96), (64, 256), (4096, 256), (70, 33)])
def test_each_kernel_is_f_linear_at_every_row_count(isa, kernel, dtype, out, inner):
    weight, bias = _products(dtype, out, inner)
    for b in (None, bias):
        table = KernelTable([KERNELS.index(kernel)] * len(BOUNDS))
        product = Product(weight, b, table)
        prepare([product], table, kernel, CPU, torch.float32)
        if kernel == "half":
            assert product.half.dtype == dtype
        for rows in (1, 2, 5, 6, 7, 17, 130):
            x = torch.randn(rows, inner)
            expected = F.linear(x, weight, b)
            got = product(x)
            assert got.dtype == torch.float32 and got.shape == (rows, out)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_sixteen_bits_only_where_they_lose_nothing():
    weight, _ = _products(torch.float16)
    assert half_weights.lossless_dtype(weight) == torch.float16
    assert half_weights.lossless_dtype(_products(torch.bfloat16)[0]) == torch.bfloat16
    assert half_weights.lossless_dtype(weight + 1e-4) is None  # float32 values: never narrowed
    assert half_weights.lossless_dtype(weight.half()) is None  # only float32 weights are narrowed
    packed = half_weights.pack(weight, torch.float16, 64)  # [300, 96] → 5 panels of 64, zero-padded
    assert packed.shape == (5, 96, 64) and packed.dtype == torch.float16
    assert torch.equal(packed.transpose(1, 2).reshape(320, 96)[:300].float(), weight)
    assert not packed[4, :, 300 - 256:].any()
    table = KernelTable()
    with pytest.raises(ValueError, match="not float16 or bfloat16 values"):
        prepare([Product(weight + 1e-4, None, table)], table, "half", CPU, torch.float32)


def test_the_kernel_builds_here_and_names_its_instruction_set(isa):
    module = native.module()
    assert module is not None, native.unavailable_reason()
    assert module.isa() == isa and module.best_isa() in ("avx512", "avx2", "scalar")
    assert module.panel_width() == {"avx512": 64, "avx2": 16, "scalar": 16}[isa]
    weight, _ = _products(torch.float16, 64, 32)
    with pytest.raises(RuntimeError, match="packed for panels of"):
        module.half_linear(torch.randn(2, 32), half_weights.pack(weight, torch.float16, 8), 64, None)
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        module.set_isa("neon")
    with pytest.raises(RuntimeError, match="x has 31 columns"):
        module.half_linear(torch.randn(2, 31), half_weights.pack(weight, torch.float16, module.panel_width()), 64, None)


def test_calibration_times_every_kernel_per_range_and_drops_unused_copies():
    weight, bias = _products(torch.float16, 512, 256)
    table = KernelTable()
    products = [Product(weight, bias, table) for _ in range(3)]
    timings = prepare(products, table, "auto", CPU, torch.float32)
    assert sorted(timings) == sorted(PROBES)
    for rows in PROBES:
        assert set(timings[rows]) == set(KERNELS) and all(ms > 0 for ms in timings[rows].values())
    assert table.kernels == choose(timings)
    used = table.used()
    assert all((p.packed is not None) == ("onednn" in used) and (p.half is not None) == ("half" in used)
               for p in products)
    assert prepare(products, table, "aten", CPU, torch.float32) == {} and table.used() == {"aten"}
    with pytest.raises(ValueError, match="auto, aten, onednn, half"):
        prepare(products, table, "mkl", CPU, torch.float32)
    assert calibrate  # the timing loop itself is what prepare ran above


def timings_by_rows(**per_kernel: list[float]) -> dict[int, dict[str, float]]:
    """{rows: {kernel: ms}} from each kernel's times at PROBES' row counts in order."""
    return {rows: {k: times[i] for k, times in per_kernel.items()} for i, rows in enumerate(PROBES)}


def test_one_kernel_runs_every_row_count_unless_another_is_twice_as_fast():
    """The AVX-512 EPYC's target timings (ms at 1, 2, 4, 6, 12, 24, 48, 96 rows): the compact
    kernel from one row, oneDNN within 7 % of it at 96 rows. Choosing the fastest per range
    took oneDNN there whenever a busy machine's noise favoured it, and with it other bits
    for a batch of more than 64 rows than for the same session alone."""
    epyc = timings_by_rows(aten=[3.52, 4.34, 5.46, 6.2, 7.17, 9.88, 15.32, 25.9],
                           onednn=[3.92, 4.53, 3.39, 3.43, 4.83, 7.18, 11.98, 19.5],
                           half=[0.91, 0.96, 1.19, 1.51, 2.82, 5.37, 10.34, 20.22])
    assert choose(epyc) == [KERNELS.index("half")] * len(PROBES)
    # a replica's start-up on a loaded machine (a chaos soak) read the compact kernel slower
    # than oneDNN at 6 rows, and chose "1-4: half, 5-8: onednn, 9+: half"
    noisy = timings_by_rows(aten=[3.6, 4.5, 5.6, 6.3, 7.3, 10.1, 15.9, 26.4],
                            onednn=[4.0, 4.6, 3.4, 3.5, 4.9, 7.3, 12.1, 19.9],
                            half=[0.93, 0.98, 1.21, 3.9, 2.9, 5.5, 10.5, 20.6])
    assert choose(noisy) == [KERNELS.index("half")] * len(PROBES)
    # more than twice as fast at a range does take that range
    big = timings_by_rows(aten=[1.0] * 8, onednn=[2.0] * 6 + [0.4, 0.4], half=[0.9] * 8)
    assert [KERNELS[k] for k in choose(big)] == ["half"] * 6 + ["onednn"] * 2
    # aten stays unless another is under 0.95 of its time per row, summed
    assert choose(timings_by_rows(aten=[1.0] * 8, onednn=[0.96] * 8)) == [KERNELS.index("aten")] * 8


def test_the_batch_invariant_kernel_gives_way_only_to_one_a_quarter_faster():
    """The compact kernel makes a session's bits independent of its batch company, which
    seeded samples reproduce by across replicas: another kernel replaces it only under 0.8
    of its time per row, summed."""
    for other in ("aten", "onednn"):
        rest = {} if other == "aten" else {"aten": [2.0] * 8}  # aten is always timed
        near = timings_by_rows(**rest, **{other: [0.85] * 8}, half=[1.0] * 8)
        assert choose(near) == [KERNELS.index("half")] * 8
        far = timings_by_rows(**rest, **{other: [0.75] * 8}, half=[1.0] * 8)
        assert choose(far) == [KERNELS.index(other)] * 8


@pytest.mark.parametrize("kernels", ["aten", "onednn", "half", "auto"])
def test_a_runner_on_any_kernel_computes_the_models_logits(target_model, kernels):
    runner = ModelRunner(target_model, linear_kernels=kernels)
    if kernels != "auto":
        assert runner.kernels.used() == {kernels}
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, runner.vocab_size, (30,), generator=gen)
    b = torch.randint(0, runner.vocab_size, (9,), generator=gen)
    ca, cb = runner.new_cache(), runner.new_cache()
    runner.forward([ForwardItem(ca, a[:25], 1), ForwardItem(cb, b[:4], 1)])
    one = runner.forward([ForwardItem(ca, a[25:26], 1)])[0]  # a lone step: one row
    both = runner.forward([ForwardItem(ca, a[26:], 4), ForwardItem(cb, b[4:], 5)])  # 9 rows
    assert torch.allclose(one, reference_logits(target_model, a[:26])[-1:], atol=1e-4)
    assert torch.allclose(both[0], reference_logits(target_model, a)[-4:], atol=1e-4)
    assert torch.allclose(both[1], reference_logits(target_model, b)[-5:], atol=1e-4)


def test_a_model_with_no_other_kernel_uses_f_linear_and_a_forced_one_is_refused(draft_model):
    half = ModelRunner(copy.deepcopy(draft_model).half(), linear_kernels="auto")  # float16 on a CPU
    assert half.kernels.used() == {"aten"} and half.kernel_timings == {}
    with pytest.raises(ValueError, match="oneDNN"):
        ModelRunner(copy.deepcopy(draft_model).half(), linear_kernels="onednn")
    with pytest.raises(ValueError, match="float32 models on a CPU"):
        ModelRunner(copy.deepcopy(draft_model).half(), linear_kernels="half")
