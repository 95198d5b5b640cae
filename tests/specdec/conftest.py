"""Fixtures of the specdec tests: specdec.native's kernels on each instruction set."""
import pytest

from specdec import native

ISAS = ("avx512", "avx2", "scalar")


@pytest.fixture(params=ISAS)
def isa(request):
    """The native kernels run on `request.param` for the test (skipped where this CPU lacks
    it), then on the best again: one machine checks every path it can run."""
    module = native.module()
    assert module is not None, native.unavailable_reason()
    order = ISAS.index
    if order(request.param) < order(module.best_isa()):
        pytest.skip(f"this CPU has no {request.param}")
    before = module.set_isa(request.param)
    yield request.param
    module.set_isa(before)
