"""The runner's two CPU product kernels: each gives F.linear's numbers to float precision at
any row count, the table sends each row count to the kernel chosen for its range, and a
runner on either kernel computes the model's logits."""
import pytest
import torch
import torch.nn.functional as F

from specdec.linear_kernels import BOUNDS, PROBES, KernelTable, Product, calibrate
from specdec.model_runner import ForwardItem, ModelRunner
from tests.specdec.test_model_runner import reference_logits


def test_every_row_count_falls_in_its_range():
    table = KernelTable([False, False, True, True, True, True, False, True])
    assert [table.use_packed(n) for n in (1, 2, 3, 4, 5, 64, 65, 128, 129, 10_000)] == \
        [False, False, True, True, True, False, True, True, True, True]
    assert table.describe() == "1-2: aten, 3-32: onednn, 33-64: aten, 65+: onednn"
    assert KernelTable().describe() == "1+: aten"
    assert all(lo <= hi for lo, hi in zip(PROBES, BOUNDS))  # each range is timed at a row count inside it


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_the_packed_product_is_f_linear_at_every_row_count(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 96, generator=gen).to(dtype)
    bias = torch.randn(300, generator=gen).to(dtype)
    for with_bias in (None, bias):
        product = Product(weight, with_bias, KernelTable([True] * len(BOUNDS)))
        product.pack()
        for rows in (1, 2, 5, 17, 130):
            x = torch.randn(rows, 96, generator=gen).to(dtype)
            expected = F.linear(x.float(), weight.float(), None if with_bias is None else with_bias.float())
            got = product(x)
            assert got.dtype == dtype and got.shape == (rows, 300)
            assert torch.allclose(got.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_calibration_fills_the_table_for_each_mode():
    table = KernelTable()
    product = Product(torch.randn(64, 32), None, table)
    product.pack()
    assert calibrate([product], table, "onednn") == {} and all(table.packed)
    assert calibrate([product], table, "aten") == {} and not any(table.packed)
    timings = calibrate([product], table, "auto", rounds=1)
    assert sorted(timings) == sorted(PROBES) and all(a > 0 and b > 0 for a, b in timings.values())
    assert table.packed == [timings[r][1] < 0.95 * timings[r][0] for r in PROBES]
    with pytest.raises(ValueError, match="auto, aten, onednn"):
        calibrate([product], table, "mkl")


@pytest.mark.parametrize("kernels", ["aten", "onednn", "auto"])
def test_a_runner_on_either_kernel_computes_the_models_logits(target_model, kernels):
    runner = ModelRunner(target_model, linear_kernels=kernels)
    assert all(runner.kernels.packed) if kernels == "onednn" else True
    assert not any(runner.kernels.packed) if kernels == "aten" else True
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


def test_a_gpu_or_an_unsupported_dtype_refuses_onednn_and_auto_falls_back(draft_model):
    half = ModelRunner(_copy(draft_model).half(), linear_kernels="auto")
    assert not any(half.kernels.packed) and half.kernel_timings == {}
    with pytest.raises(ValueError, match="oneDNN"):
        ModelRunner(_copy(draft_model).half(), linear_kernels="onednn")


def _copy(model):
    import copy
    return copy.deepcopy(model)
